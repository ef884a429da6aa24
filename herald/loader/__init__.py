"""Sources, decoding, batching, prefetch and resumable position (docs/design.md, "Roles").

Public API (see docs/loader.md):

- :func:`open_source`, :func:`register_format`, :class:`Source`
- :func:`decode_records` (one raw text line per record, e.g. a Kafka message)
- :mod:`herald.loader.arrow` (``batch_to_arrow`` / ``arrow_to_batch``)
- :class:`GlobalBatcher`
- :func:`convert`, :func:`datagen`, :class:`SyntheticSpec`, :class:`SyntheticSource`
"""

from herald.loader.batch import SampleBatch, Schema
from herald.loader.batcher import GlobalBatcher
from herald.loader.convert import convert, datagen
from herald.loader.decode import decode_records
from herald.loader.registry import open_source, register_format
from herald.loader.source import Source
from herald.loader.synthetic import SyntheticSource, SyntheticSpec

__all__ = ["Schema", "SampleBatch", "Source", "open_source", "register_format", "decode_records",
           "GlobalBatcher", "convert", "datagen", "SyntheticSpec", "SyntheticSource"]
