"""The dispatcher's registry of the consistency modes: each mode's serve strategy and embedding worker.

One :class:`DispatchMode` per mode of :data:`herald.contracts.vocab.CONSISTENCY_MODES`, keyed
by its name (:mod:`herald.contracts.modes`); a new mode adds its entry here
(docs/consistency.md, "Adding a mode").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from herald.contracts.modes import BoundedSettings, BspSettings, GbaSettings, HybridSettings, consistency_mode
from herald.dispatch.embedding_worker import EmbeddingWorker, no_embedding_worker
from herald.dispatch.gba import serve_gba
from herald.dispatch.hybrid import make_hybrid
from herald.dispatch.records import StepRecord
from herald.errors import ConfigError


def serve_steps(disp: Any) -> list[StepRecord]:
    """The serve strategy of the plan-driven modes (bsp, bounded, hybrid): global steps handed
    out within the credit window, with checkpoint barriers and the final flush
    (:meth:`herald.dispatch.lockstep.LockstepServe.serve` of the dispatcher ``disp``)."""
    return disp.lockstep.serve()


@dataclasses.dataclass(frozen=True)
class DispatchMode:
    """What a dispatcher runs under one mode.

    Attributes:
        serve: ``serve(dispatcher) -> list[StepRecord]``, the hand-out loop after the handshake
            (:meth:`herald.dispatch.dispatcher.Dispatcher.serve`).
        embedding_worker: a factory ``(job, config, first_step, peers) -> worker`` of the
            dispatcher-side embedding worker (hybrid's, NOTE [hybrid training] in
            herald/dispatch/hybrid.py), made when the dispatcher sends its first step; by
            default the null one (:class:`~herald.dispatch.embedding_worker.NullEmbeddingWorker`):
            the workers write the PS themselves.
        warm_resume: a final barrier off the checkpoint grid saves the scheduler and the
            worker caches, and a resume loads them (NOTE [warm resume] in
            herald/dispatch/warm.py): the modes whose worker caches follow the plan.
    """

    serve: Callable[[Any], list[StepRecord]]
    embedding_worker: Callable[..., EmbeddingWorker] = no_embedding_worker
    warm_resume: bool = False


#: Each mode's dispatcher parts, by mode name.
DISPATCH: dict[str, DispatchMode] = {
    BspSettings.name: DispatchMode(serve_steps, warm_resume=True),
    BoundedSettings.name: DispatchMode(serve_steps, warm_resume=True),
    HybridSettings.name: DispatchMode(serve_steps, make_hybrid),
    GbaSettings.name: DispatchMode(serve_gba),  # NOTE [gba tokens]
}


def dispatch_mode(name: str) -> DispatchMode:
    """The dispatcher's parts under mode ``name``.

    Raises:
        ConfigError: an unknown mode, or one without an entry here (the known ones listed).
    """
    mode = consistency_mode(name).name
    if mode not in DISPATCH:
        raise ConfigError(f"no dispatcher serve strategy for --consistency {mode}; known: {', '.join(DISPATCH)}")
    return DISPATCH[mode]
