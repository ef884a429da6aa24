"""herald: a data loader and embedding scheduler for recommendation-model training.

Subpackages follow the data flow of ``docs/design.md``:

- :mod:`herald.loader`    sources -> columnar :class:`~herald.loader.batch.SampleBatch`
- :mod:`herald.scheduler` allocation (LAIA), cache snapshots, communication plan
- :mod:`herald.ps`        the embedding parameter server and its client
- :mod:`herald.worker`    dispatcher, worker embedding cache, PyTorch-facing API
"""

from herald.errors import (
    ConfigError,
    DataError,
    HeraldError,
    PeerTimeout,
    ProtocolError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "HeraldError",
    "PeerTimeout",
    "ProtocolError",
    "__version__",
]
