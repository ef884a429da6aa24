"""herald: a data loader and embedding scheduler for recommendation-model training.

Subpackages, from the contracts up in data-flow order (docs/design.md, "Package layout";
the import layers they form: docs/design.md, "Layers"):

- :mod:`herald.contracts`      the contracts layer: JobSpec, TrainConfig, TableConfig, every
  vocabulary and default
- :mod:`herald.loader`    sources -> columnar :class:`~herald.loader.batch.SampleBatch`
  -> global batches
- :mod:`herald.scheduler` allocation (LAIA), cache snapshots, communication plan,
  accounting (pure computation)
- :mod:`herald.ps`        the embedding parameter server and its client
- :mod:`herald.dispatch`  the dispatcher: scheduled micro-batches to the workers over
  ZeroMQ (also Persia's embedding worker, GBA's data and token lists)
- :mod:`herald.worker`    the worker runtime: PyTorch-facing API, consistency protocols,
  plan executor and embedding cache, dense sync, models
- :mod:`herald.job`       ``herald train``: the job runner, checkpoints, report
- :mod:`herald.bench`     ``herald bench ...``: benchmarks, each against a baseline
- :mod:`herald.testbed`   a multi-host test bed on one machine (network namespaces)

Shared mechanisms sit at the root: :mod:`herald.errors`, :mod:`herald.config`,
:mod:`herald.wire`, :mod:`herald.keymap`, :mod:`herald.hashing`, :mod:`herald.auth`,
:mod:`herald.procs`, :mod:`herald.phases`.
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
