"""What the scheduler tells each worker to do in one step: the cache plan.

A contract between the two (docs/design.md, "Layers"): :mod:`herald.scheduler` builds
these types, :mod:`herald.worker` executes them, and the micro-batch carries them
(:mod:`herald.contracts.microbatch`); this module imports numpy only.

NOTE [step protocol] (docs/design.md, "Consistency protocol"; Herald §3.3, §4.4).
Worker ``w`` executes step ``t``
in this order; every list comes from its :class:`CachePlan`:

1. ``evict``: drop these cached rows, in order. For the rows flagged in
   ``write_back`` the worker holds the only latest copy: it first sends row and
   optimizer state to the PS (``push_rows``; counted as ``evict_push``).
2. ``pull``: fetch these rows (embedding + optimizer state) from the PS and
   store them in the cache (a key already cached is overwritten in place: an
   ``update_pull``; otherwise a ``miss_pull``). The protocol guarantees the PS
   copy is latest at that moment. After steps 1-2 every key the micro-batch
   uses is cached and latest.
3. forward / backward over the micro-batch.
4. ``grad_push``: send the gradient (summed over this micro-batch) of these
   keys to the PS with ``contributors[i]`` = number of workers that push key
   ``i`` this step. The PS sums the contributions of one (key, step) in rank
   order and applies the optimizer once, when all have arrived. The worker
   waits for the acknowledgement. These cached copies are now stale unless the
   key is also in ``update_local``.
5. ``update_local``: apply the sparse optimizer (the PS's kernels, bit-identical)
   to these cached rows with this worker's gradient. Under herald's plan these
   are the keys only this worker used; the copy is now the only latest one.
   Under full-set sync (``vanilla``/``laia``) the same keys are also in
   ``grad_push`` with ``contributors == 1``, so PS and worker apply the same
   update and both copies stay latest.
6. ``plan_push``: after 5, send these rows with optimizer state to the PS
   (``push_rows``), because another worker uses them at step ``t + 1``
   (Herald Alg. 2). The copy stays cached and latest.
7. dense all-reduce (or the sum the step messages bring: NOTE [dense gradients on the
   shards] in herald/ps/stepped.py) and dense optimizer step; ack the step to the dispatcher.

Steps 4-6 of every worker are applied before any pull of step ``t + 1`` is read,
so each pull in step ``t + 1`` sees them.

As executed (herald/worker/protocol.py, ``BSP``), a worker sends 4-6 of step ``t``, with
1-2 of step ``t + 1`` when that micro-batch is already here, as one step message per
shard, and each shard answers the pulls only once every worker's step-``t`` message has
been applied (NOTE [step messages] in herald/ps/stepped.py): the shards, not the
all-reduce of 7, order the writes of ``t`` before the reads of ``t + 1``, so 7 overlaps
the round trip. The relaxed modes keep the earlier order: writes acknowledged just
before 7, and pulls of ``t + 1`` that no worker's 1, 4 or 6 touches at ``t`` issued while
``t`` computes (NOTE [early pulls] in herald/dispatch/early.py).
Copies of a key updated at the PS in step 4 go stale in *every* cache that
holds them, including workers that did not use the key: the scheduler tracks
this, and plans an ``update_pull`` when a stale copy is needed again.

The worker cache runs no eviction policy of its own: it evicts exactly the
``evict`` lists, with capacity ``Scheduler.capacity_rows``. The scheduler's exact
conventions (canonical key order, LRU/LFU victim order, plan-push order) are in
docs/scheduler.md, "Exact semantics".

Keys are (table index, id) pairs: ``table`` int32 [n] and ``ids`` uint64 [n].
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: Causes of transmission counted per worker per step (NOTE [step protocol] above).
CAUSES = ("hit", "miss_pull", "update_pull", "grad_push", "plan_push", "evict_push")


@dataclasses.dataclass
class KeySet:
    """A list of feature keys: ``table`` int32 [n] and ``ids`` uint64 [n]."""

    table: np.ndarray
    ids: np.ndarray

    def __post_init__(self) -> None:
        self.table = np.ascontiguousarray(self.table, dtype=np.int32)
        if self.ids.dtype != np.uint64:
            raise TypeError(f"KeySet ids must be uint64, got {self.ids.dtype}")
        if self.table.shape != self.ids.shape or self.ids.ndim != 1:
            raise ValueError(f"KeySet table {self.table.shape} and ids {self.ids.shape} must be equal 1-d shapes")

    @classmethod
    def empty(cls) -> KeySet:
        return cls(np.zeros(0, np.int32), np.zeros(0, np.uint64))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def by_table(self) -> dict[int, np.ndarray]:
        """``{table index: uint64 ids}`` for the tables present, ids in list order."""
        out: dict[int, np.ndarray] = {}
        if len(self) == 0:
            return out
        for t in np.unique(self.table):
            out[int(t)] = self.ids[self.table == t]
        return out

    def as_set(self) -> set[tuple[int, int]]:
        """Python set of ``(table, id)`` (for tests and debug checks)."""
        return set(zip(self.table.tolist(), self.ids.tolist()))


@dataclasses.dataclass
class CachePlan:
    """One worker's instructions for one step; see NOTE [step protocol] for the order.

    Attributes:
        evict: keys to drop before pulling, in order.
        write_back: bool [len(evict)]: push the row to the PS before dropping it.
        pull: keys to fetch (embedding + optimizer state) before forward.
        grad_push: keys whose gradient goes to the PS after backward.
        contributors: uint16 [len(grad_push)]: workers pushing each key this step.
        update_local: keys whose cached row gets the optimizer update locally.
        plan_push: keys whose latest row goes to the PS after the update.
    """

    evict: KeySet
    write_back: np.ndarray
    pull: KeySet
    grad_push: KeySet
    contributors: np.ndarray
    update_local: KeySet
    plan_push: KeySet

    @classmethod
    def empty(cls) -> CachePlan:
        return cls(
            KeySet.empty(),
            np.zeros(0, bool),
            KeySet.empty(),
            KeySet.empty(),
            np.zeros(0, np.uint16),
            KeySet.empty(),
            KeySet.empty(),
        )
