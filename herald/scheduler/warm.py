"""The scheduler's warm state: what a scheduler carries from one step into the next, saved
at a checkpoint off the checkpoint grid (NOTE [warm resume] in herald/dispatch/warm.py).

A fresh scheduler starts from empty snapshots, the seed's RNG and no pending step (NOTE
[scheduler state] in herald/scheduler/scheduler.py): exactly the state after a checkpoint
barrier on the grid, where the workers empty their caches. A job stopped between two
barriers (``--steps``, SIGTERM) leaves warm caches behind in the uninterrupted run, so
its resume must start from the scheduler's whole state instead:

==================  =====================================================================
part                arrays (``(meta, arrays)`` of :func:`pack`)
==================  =====================================================================
cache snapshots     every array of :class:`~herald.scheduler.state.Snapshots` (``snap.*``):
                    key map, records (cached, valid, owner, LRU/LFU position), LRU log or
                    LFU heap, sizes, dedup tokens, popularity
allocation          the allocator's RNG and k (``alloc.*``), the table profiler's DoI and
                    counters (adaptive LAIA)
pending step        the last submitted step (``pending.*``), whose plan pushes the next
                    batch's allocation decides (Herald Alg. 2): its allocation, keys and
                    before/after passes
counters            ``next_step``, the samples per worker seen, the totals
==================  =====================================================================

It is taken before :meth:`~herald.scheduler.Scheduler.finish` (which would finish the
pending step without plan pushes). A scheduler given it back
(:meth:`~herald.scheduler.Scheduler.load_warm_state`) returns, on its next ``submit``,
the pending step's plan with the plan pushes the uninterrupted run had; that step was
trained already, so the caller uses the plan only for what the next step needs of it
(the keys it touched: NOTE [early pulls] in herald/dispatch/early.py) and sends it to no
worker. The budget controller's timing history (``scheduling_budget_ms``) is not part of
it: it is measured, not computed, and a budgeted k is never reproducible anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from herald.errors import DataError

#: ``meta["format"]`` of a warm state.
WARM_FORMAT = "scheduler-warm"
_BEFORE, _AFTER = 5, 5


@dataclasses.dataclass
class Pending:
    """A submitted step whose plan waits for the next step's allocation (its plan pushes).

    Attributes:
        step: its number (this scheduler's). worker_of: int32 [B]; order: int64 [B] (its
            samples grouped by worker); counts: int64 [W, len(CAUSES)]; keys: int32 [nnz']
            at ``off`` int64 [W + 1] (each worker's keys, canonical order); before, after:
            the outputs of its before-forward and after-backward passes
            (:meth:`~herald.scheduler.state.Snapshots.before_forward`, ``after_backward``).
    """

    step: int
    worker_of: np.ndarray
    order: np.ndarray
    counts: np.ndarray
    keys: np.ndarray
    off: np.ndarray
    before: tuple
    after: tuple

    def arrays(self) -> dict[str, np.ndarray]:
        """Its arrays by name (``before0`` ... ``after4``), copies."""
        out = {k: getattr(self, k).copy() for k in ("worker_of", "order", "counts", "keys", "off")}
        out.update({f"before{i}": np.array(a) for i, a in enumerate(self.before)})
        out.update({f"after{i}": np.array(a) for i, a in enumerate(self.after)})
        return out

    @classmethod
    def of_arrays(cls, step: int, arrays: dict[str, np.ndarray]) -> Pending:
        """The inverse of :meth:`arrays` (``arrays`` checked by :func:`unpack`)."""
        before = tuple(arrays[f"before{i}"] for i in range(_BEFORE))
        after = tuple(arrays[f"after{i}"] for i in range(_AFTER))
        a = arrays
        return cls(step, a["worker_of"], a["order"], a["counts"], a["keys"], a["off"], before, after)


def pack(state: dict, pending: Pending, samples_seen: int, snapshots, allocator) -> tuple[dict, dict[str, np.ndarray]]:
    """The warm state ``(meta JSON-able, arrays by name)`` of a scheduler whose resumable
    state is ``state`` (:func:`~herald.scheduler.saved_state.scheduler_state`), with the step
    ``pending`` submitted and not finished, ``samples_seen`` per worker, its ``snapshots``
    (:class:`~herald.scheduler.state.Snapshots`) and ``allocator``
    (:class:`~herald.scheduler.allocation.Allocator`)."""
    arrays = {f"snap.{k}": v for k, v in snapshots.arrays().items()}
    arrays.update({f"alloc.{k}": v for k, v in allocator.warm_arrays().items()})
    arrays.update({f"pending.{k}": v for k, v in pending.arrays().items()})
    meta = {"format": WARM_FORMAT, "scheduler": state, "pending_step": pending.step, "samples_seen": samples_seen}
    return meta, arrays


def scheduler_part(meta: Any) -> dict:
    """The resumable scheduler state inside a warm ``meta`` (for
    :func:`~herald.scheduler.saved_state.check_scheduler_state`).

    Raises:
        DataError: not a warm state's meta.
    """
    if not isinstance(meta, dict) or meta.get("format") != WARM_FORMAT:
        raise DataError("not a scheduler warm state; pass Scheduler.warm_state()")
    scheduler = meta.get("scheduler")
    if not isinstance(scheduler, dict):
        raise DataError("not a scheduler warm state (no 'scheduler' part); pass Scheduler.warm_state()")
    return scheduler


def unpack(meta: dict, arrays: dict[str, np.ndarray], snapshots, allocator) -> tuple[Pending, int]:
    """Load a :func:`pack` result into ``snapshots`` and ``allocator`` (of a scheduler with the
    same settings, already checked); returns ``(pending step, samples seen per worker)``.

    Raises:
        DataError: a part is missing or does not fit (another layout, a torn file).
    """
    step, seen = meta.get("pending_step"), meta.get("samples_seen")
    if not (isinstance(step, int) and isinstance(seen, int)) or isinstance(step, bool) or isinstance(seen, bool):
        raise DataError(f"malformed scheduler warm state: pending_step {step!r}, samples_seen {seen!r}")
    if step < 0 or seen < 0:
        raise DataError(f"malformed scheduler warm state: pending_step {step!r}, samples_seen {seen!r}")

    def part(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

    pending = part("pending.")
    need = {"worker_of", "order", "counts", "keys", "off"} | {f"before{i}" for i in range(_BEFORE)}
    need |= {f"after{i}" for i in range(_AFTER)}
    if set(pending) != need:
        raise DataError(f"malformed scheduler warm state: the pending step has {sorted(pending)}, needs {sorted(need)}")
    snapshots.load_arrays(part("snap."))
    allocator.load_warm_arrays(part("alloc."))
    return Pending.of_arrays(step, pending), seen
