"""Checkpoint barriers and the position they save (NOTE [checkpoint barrier] in
herald/dispatch/dispatcher.py; GBA's: NOTE [gba checkpoints] in herald/dispatch/gba.py).

:class:`Barriers` holds the dispatcher's position in its data (the global batches, the
index of the next one, the steps checkpointed, the first step of this process) and runs
a barrier's messages once the serve loop has drained its steps: flush every worker, have
rank 0 save the dense state, call ``on_checkpoint`` with :meth:`Barriers.state_dict`. It
is also where that state is checked and loaded (``load_state_dict``). When a barrier is
due is the serve loop's decision (:mod:`herald.dispatch.lockstep`,
:class:`herald.dispatch.gba.GbaServe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from herald.dispatch.channel import PeerChannel
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.ledger import StepLedger
from herald.dispatch.records import check_state
from herald.dispatch.warm import WarmState, save_scheduler
from herald.errors import ConfigError, HeraldError


class Barriers:
    """The checkpoint barriers of one dispatcher and the position they save.

    Args:
        config: the dispatcher's settings (``num_workers``, ``first_step``).
        batches: the global batches (their ``state_dict`` / ``load_state_dict``, when they
            have them, are part of the dispatcher's state).
        channel: the :class:`~herald.dispatch.channel.PeerChannel` to the workers.
        ledger: the :class:`~herald.dispatch.ledger.StepLedger` (its next step and steps in flight).
        on_checkpoint: ``on_checkpoint(step, batch_index, save_path, state)`` at each barrier.
        checkpoint_path: ``checkpoint_path(step) -> str``, the folder the workers save to.

    Attributes:
        batches: as given. next_batch: index of the next global batch to read.
        first_step: first step of this process (resumed: the state's).
        at_barrier: nothing held or in flight (:meth:`state_dict` is valid).
        checkpoints: the steps checkpointed, ascending.
    """

    def __init__(
        self,
        config: DispatcherConfig,
        batches: Iterable[Any],
        channel: PeerChannel,
        ledger: StepLedger,
        *,
        on_checkpoint: Callable[[int, int, str, dict], None] | None = None,
        checkpoint_path: Callable[[int], str] | None = None,
    ):
        self.batches = batches
        self._workers = config.num_workers
        self._channel, self._ledger = channel, ledger
        self._on_checkpoint, self._checkpoint_path = on_checkpoint, checkpoint_path
        self.next_batch = 0
        self.first_step = config.first_step
        self.at_barrier = True
        self.checkpoints: list[int] = []

    @property
    def checkpointing(self) -> bool:
        """Whether the barriers write checkpoints (an ``on_checkpoint`` was given)."""
        return self._on_checkpoint is not None

    def batch_read(self, index: int) -> None:
        """Global batch ``index`` was read: the next is ``index + 1``, and the position is
        no longer at a barrier (the reading thread calls it)."""
        self.next_batch, self.at_barrier = index + 1, False

    # --------------------------------------------------------------- barrier
    def flush(self, arrays_per_rank: Iterable[Sequence[np.ndarray]], reset: bool) -> None:
        """Send ``flush {reset} [table, ids]`` to every rank (its arrays in rank order) and
        wait for every ``flushed``."""
        for rank, arrays in enumerate(arrays_per_rank):
            self._channel.send(rank, {"op": "flush", "reset": reset}, arrays)
        self._channel.expect(set(range(self._workers)), "flushed")

    def complete(self, step: int, batch_index: int, warm: WarmState | None = None) -> None:
        """The barrier after ``step`` (global batch ``batch_index``) is drained and flushed:
        checkpoint it when the job does, once per step, and only for a step this process
        trained (:meth:`save`)."""
        self.at_barrier = True
        if self._on_checkpoint is None or step < self.first_step or step in self.checkpoints:
            return
        self.save(step, batch_index, warm)

    def save(self, step: int, batch_index: int, warm: WarmState | None = None) -> None:
        """At a complete barrier: rank 0 saves the dense state, then ``on_checkpoint``
        (NOTE [checkpoint barrier]; the GBA dispatcher's barrier too, NOTE [gba checkpoints]).
        With ``warm`` (a final barrier off the grid, NOTE [warm resume]) every rank also saves
        its cache and the scheduler's warm state goes into the folder and the state."""
        path = self._checkpoint_path(step) if self._checkpoint_path else ""
        warm = warm if path else None
        if path:
            ranks = set(range(self._workers)) if warm is not None else {0}
            for rank in sorted(ranks):
                self._channel.send(rank, {"op": "save", "path": path, "caches": warm is not None})
            self._channel.expect(ranks, "saved")
        self.checkpoints.append(step)
        state = self.state_dict()
        if warm is not None:
            state["warm"] = save_scheduler(path, warm)
        self._on_checkpoint(step, batch_index, path, state)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The job's position at a checkpoint barrier (or before serving, or after it).

        ``{"format": "dispatcher", "num_workers", "next_step", "next_batch" (index of
        the next global batch), "checkpoints" (steps checkpointed), "batches" (the
        producer's ``state_dict()``, or None when it has none)}``; JSON-able.

        Raises:
            HeraldError: called between barriers, where batches sit in the scheduler and
                steps are in flight (NOTE [checkpoint barrier]: take it in ``on_checkpoint``).
        """
        if not self.at_barrier or self._ledger.in_flight:
            raise HeraldError(
                "Dispatcher.state_dict() is complete only at a checkpoint barrier (NOTE [checkpoint "
                "barrier]): between barriers the scheduler holds batches and steps are in flight; "
                "take the state given to on_checkpoint"
            )
        get = getattr(self.batches, "state_dict", None)
        return {
            "format": "dispatcher",
            "num_workers": self._workers,
            "next_step": self._ledger.next_step,
            "next_batch": self.next_batch,
            "checkpoints": list(self.checkpoints),
            "batches": get() if get is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict` taken at a barrier), before serving.

        Raises:
            DataError: malformed state. ConfigError: saved with another number of workers,
                or it holds a producer position and ``batches`` cannot load one.
        """
        next_step, next_batch, done = check_state(state, self._workers)
        if state.get("batches") is not None:
            load = getattr(self.batches, "load_state_dict", None)
            if load is None:
                raise ConfigError(
                    "the state holds a global-batch position but these batches cannot load one; "
                    "pass a herald.loader.global_batches.GlobalBatches"
                )
            load(state["batches"])
        self._ledger.next_step = self.first_step = next_step
        self.next_batch = next_batch
        self.checkpoints = list(done)
