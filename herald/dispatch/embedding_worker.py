"""The dispatcher-side embedding worker seam: what the step ledger asks of it, and the null one.

Under a mode whose workers write the PS themselves (bsp, bounded, gba) the ledger
(:class:`~herald.dispatch.ledger.StepLedger`) holds a :class:`NullEmbeddingWorker`, which
does nothing; under hybrid, Persia's embedding worker (:class:`~herald.dispatch.hybrid.
HybridEmbeddingWorker`, NOTE [hybrid training] in herald/dispatch/hybrid.py). Each mode's
factory is its entry in :data:`herald.dispatch.modes.DISPATCH`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from herald.dispatch.idbuffer import IdFeatureBuffer


class EmbeddingWorker(Protocol):
    """What the step ledger calls, serve thread only (the hybrid worker's methods document each)."""

    def before_send(self, step: int) -> None:
        """Called right before ``step`` is sent; may wait (bounded) for earlier steps' updates."""

    def receive(
        self, step: int, rank: int, arrays: list[np.ndarray], buffer: IdFeatureBuffer, newest_step: int
    ) -> list[np.ndarray]:
        """Take what is its of an ack's ``arrays``; returns the others."""

    def step_acked(self, step: int, buffer: IdFeatureBuffer) -> dict[str, int]:
        """Every worker acked ``step``: returns the step's counters for its record."""

    def drain(self) -> None:
        """Wait (bounded) until every update it took is applied (a checkpoint barrier)."""

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop its threads, bounded by ``timeout_s``; idempotent."""


class NullEmbeddingWorker:
    """The embedding worker of a mode whose workers write the PS themselves: does nothing."""

    def before_send(self, step: int) -> None:
        return None

    def receive(
        self, step: int, rank: int, arrays: list[np.ndarray], buffer: IdFeatureBuffer, newest_step: int
    ) -> list[np.ndarray]:
        return arrays

    def step_acked(self, step: int, buffer: IdFeatureBuffer) -> dict[str, int]:
        return {}

    def drain(self) -> None:
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        return None


def no_embedding_worker(job: Any, config: Any, first_step: int, peers: Any) -> NullEmbeddingWorker:
    """The factory of :class:`NullEmbeddingWorker` (the arguments of every factory, unread)."""
    return NullEmbeddingWorker()
