"""The worker's step message: steps 4-6 of step t, with 1-2 of step t + 1, as one request
per shard (NOTE [step messages] in herald/ps/stepped.py; docs/worker.md, "The BSP step").

:class:`StepMessage` builds the message from what the plan executor holds (its cache, PS
client and timer), sends it, and puts the pulled rows in the cache when the reply comes;
the BSP protocol (herald/worker/protocol.py) decides when.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from herald.contracts.microbatch import MicroBatch
from herald.contracts.plan import CachePlan, KeySet
from herald.phases import PhaseTimer
from herald.ps import PSClient
from herald.worker.cache import RowCache
from herald.worker.rows import StepGrads, StepRows


class StepMessage:
    """Worker ``rank``'s step message in flight, at most one at a time.

    Args:
        ps: the job's :class:`PSClient`; cache: the worker cache (NOTE [cache interface] in
            herald/worker/cache.py); timer: the executor's :class:`PhaseTimer`.
        rank, world_size: this worker and the number of workers.
        update_local: the executor's local sparse update, ``update_local(plan, grads,
            step_rows)`` (step 5 of NOTE [step protocol], applied before the plan pushes are read).

    Attributes:
        dense: float32 [P] or None: the dense gradient the next message carries (NOTE [dense
            gradients on the shards] in herald/ps/stepped.py), set by the worker runtime;
            None once sent.
        bytes_dense: bytes of the dense gradients sent since the executor last took its traffic.
    """

    def __init__(
        self,
        ps: PSClient,
        cache: RowCache,
        timer: PhaseTimer,
        rank: int,
        world_size: int,
        update_local: Callable[[CachePlan, StepGrads, StepRows], None],
    ):
        self.ps, self.cache, self.timer = ps, cache, timer
        self.rank, self.world_size, self._update_local = rank, world_size, update_local
        self.dense: np.ndarray | None = None
        self.bytes_dense = 0
        self._in_flight: tuple[int | None, KeySet, Any, bool] | None = None  # (next step, pulls, handle, dense)
        self._prepared: int | None = None  # the step whose evictions and pulls are done
        self._dense_summed = False

    def send(self, mb: MicroBatch, grads: StepGrads, step_rows: StepRows, next_mb: MicroBatch | None) -> None:
        """Steps 4-6 of NOTE [step protocol] for ``mb`` as one step message per shard: the
        gradients of ``plan.grad_push``, the local updates, then the rows of ``plan.plan_push``;
        with ``next_mb`` (the micro-batch of step ``mb.step + 1``, already here) also its
        evictions' write-backs and its pulls, which :meth:`finish` puts in the cache (then
        :meth:`prepared` is its step); and :attr:`dense`, which :meth:`finish` leaves summed
        over the ranks. Nothing of the message is acknowledged until :meth:`finish`."""
        plan = mb.plan
        dense, self.dense = self.dense, None
        self.bytes_dense += 0 if dense is None else dense.nbytes
        g = None
        if len(plan.grad_push):
            with self.timer("grad_push"):
                g = grads.host_rows(step_rows.positions(plan.grad_push))
        self._update_local(plan, grads, step_rows)
        written, rows = plan.plan_push, None
        if len(written):
            with self.timer("plan_push"):
                rows = self.cache.read(self.cache.slots(written))
        pull = KeySet.empty()
        if next_mb is not None:
            written, rows = self._evict_next(next_mb.plan, written, rows)
            pull = next_mb.plan.pull
        with self.timer("step_send"):
            handle = self.ps.step_async(
                mb.step,
                self.rank,
                self.world_size,
                rows=(written.table, written.ids, rows) if rows is not None else None,
                grads=(plan.grad_push.table, plan.grad_push.ids, g, plan.contributors) if g is not None else None,
                pull=(pull.table, pull.ids),
                dense=dense,
            )
        self._in_flight = (None if next_mb is None else next_mb.step, pull, handle, dense is not None)

    def _evict_next(
        self, nplan: CachePlan, written: KeySet, rows: np.ndarray | None
    ) -> tuple[KeySet, np.ndarray | None]:
        """Evict for the next step (``nplan``, after this step's local updates) and append its
        write-backs to the rows the message writes (``written``, float32 [len(written), row_width])."""
        if not len(nplan.evict):
            return written, rows
        with self.timer("evict"):
            back = self.cache.evict(nplan.evict, nplan.write_back)
            wb = nplan.write_back
            if wb.any():
                written = KeySet(
                    np.concatenate([written.table, nplan.evict.table[wb]]),
                    np.concatenate([written.ids, nplan.evict.ids[wb]]),
                )
                rows = back if rows is None else np.concatenate([rows, back])
        return written, rows

    def finish(self) -> None:
        """Wait for the reply of :meth:`send`'s message (every rank's step writes are
        applied on every shard then) and put the pulled rows in the cache."""
        if self._in_flight is None:
            return
        step, pull, handle, self._dense_summed = self._in_flight
        self._in_flight = None
        with self.timer("step_wait"):
            rows = handle.wait()
            if len(pull):
                self.cache.put(pull, rows)
        self._prepared = step

    def take_dense_summed(self) -> bool:
        """Whether the last message's reply brought the dense sum (then forgotten)."""
        summed, self._dense_summed = self._dense_summed, False
        return summed

    def prepared(self, step: int) -> bool:
        """Whether step ``step``'s evictions and pulls came with the previous step message."""
        return self._prepared == step

    def forget_prepared(self) -> None:
        """After a barrier's flush: the next step evicts and pulls on its own."""
        self._prepared = None
