"""Sources (files, Kafka, synthetic), decoding, batching, prefetch, resumable position, the
job's global batches and train/held-out splits, the ``IterableDataset`` and TorchRec
interop (docs/design.md, "Package layout").

Public API (see docs/loader.md):

- :func:`open_source`, :func:`register_format`, :class:`Source`
- :func:`decode_records` (one raw text line per record, e.g. a Kafka message)
- :mod:`herald.loader.formats.arrow` (``batch_to_arrow`` / ``arrow_to_batch``)
- :class:`GlobalBatcher`
- :func:`convert`, :func:`datagen`, :class:`SyntheticSpec`, :class:`SyntheticSource`
"""

from herald.lazy import lazy_exports

# Names are imported on first use (PEP 562, herald/lazy.py).
_EXPORTS = {
    "SampleBatch": "batch",
    "Schema": "batch",
    "GlobalBatcher": "batcher",
    "convert": "conversion",
    "datagen": "conversion",
    "decode_records": "formats.decode",
    "open_source": "registry",
    "register_format": "registry",
    "Source": "source",
    "SyntheticSource": "synthetic",
    "SyntheticSpec": "synthetic",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
