"""Sources, decoding, batching, prefetch and resumable position (docs/design.md, "Roles")."""

from herald.loader.batch import Schema, SampleBatch

__all__ = ["Schema", "SampleBatch"]
