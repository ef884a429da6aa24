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

import importlib

# Names are imported on first use (PEP 562): a process that needs one module (a PS
# shard hashing keys, a worker reading SampleBatch) does not load every parser kernel.
_EXPORTS = {
    "SampleBatch": "batch", "Schema": "batch", "GlobalBatcher": "batcher", "convert": "conversion",
    "datagen": "conversion", "decode_records": "formats.decode", "open_source": "registry",
    "register_format": "registry", "Source": "source", "SyntheticSource": "synthetic",
    "SyntheticSpec": "synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"herald.loader.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'herald.loader' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
