"""The worker runtime (docs/worker.md): the PyTorch-facing API (``ScheduledLoader``), the
consistency protocols (bsp, bounded, hybrid, gba), the plan executor with its embedding
cache (CPU or device-resident), PS I/O and replicated tables, the dense synchroniser,
training groups, the models, and ``herald serve worker``'s training loop.

The dispatcher lives in :mod:`herald.dispatch`.
"""
