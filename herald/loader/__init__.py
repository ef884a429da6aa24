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

from herald.lazy import lazy_package

# Names are imported on first use (PEP 562, herald/lazy.py): submodule -> the names it defines.
lazy_package(
    globals(),
    {
        "batch": ("SampleBatch", "Schema"),
        "batcher": ("GlobalBatcher",),
        "conversion": ("convert", "datagen"),
        "formats.decode": ("decode_records",),
        "registry": ("open_source", "register_format"),
        "source": ("Source",),
        "synthetic": ("SyntheticSource", "SyntheticSpec"),
    },
)
