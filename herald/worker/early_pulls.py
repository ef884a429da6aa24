"""Early pulls on the worker: the pulls of the next step started while this one computes.

The dispatcher marks which pulls of step t + 1 may leave before step t's writes land
(``MicroBatch.pull_early``: NOTE [early pulls] in herald/dispatch/early.py); a worker adds
the pulls of the keys it wrote back itself at step t (NOTE [own write-backs] below).
:class:`EarlyPulls` starts them, remembers them by step and hands them to
:meth:`~herald.worker.executor.PlanExecutor.pull`, which reads the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from herald.contracts.microbatch import MicroBatch
from herald.contracts.plan import KeySet
from herald.worker import psio
from herald.worker.cache import RowCache
from herald.worker.rows import Fetch


class EarlyPulls:
    """The pulls a worker started before their step, by step.

    Args:
        cache: the worker cache (NOTE [cache interface] in herald/worker/cache.py): which
            keys it holds.
        world_size: the number of workers (alone, every "wait" pull of a key not held is
            this worker's own write-back: NOTE [own write-backs]).
        fetch: the plain :data:`~herald.worker.rows.Fetch` (every row of the keys), used
            when :meth:`prefetch` is given none.
    """

    def __init__(self, cache: RowCache, world_size: int, fetch: Fetch):
        self.cache, self.world_size, self._fetch = cache, world_size, fetch
        self._started: dict[int, tuple[np.ndarray, Callable[[], psio.Fetched]]] = {}  # step -> (mask, wait())
        self._written_back: tuple[int | None, KeySet] = (None, KeySet.empty())  # NOTE [own write-backs]

    def wrote_back(self, step: int | None, keys: KeySet) -> None:
        """Remember that the evictions of ``step`` (None: of no step, after a barrier) wrote
        back ``keys``, so that :meth:`prefetch` may fetch them early for ``step + 1``."""
        self._written_back = (step, keys)

    def prefetch(self, mb: MicroBatch, fetch: Fetch | None = None) -> None:
        """Start pulling the pulls of ``mb`` marked ``pull_early`` (NOTE [early pulls]) and
        those of this worker's own write-backs (NOTE [own write-backs]); call only once the
        step before ``mb.step - 1`` is finished on this worker. ``fetch``: how they are read
        (:data:`~herald.worker.rows.Fetch`; default: plain pulls); :meth:`prefetched` then
        names them."""
        early = mb.pull_early
        own = self.own_write_backs(mb)
        if own is not None:
            early = early | own
        if early.any() and mb.step not in self._started:
            keys = KeySet(mb.plan.pull.table[early], mb.plan.pull.ids[early])
            self._started[mb.step] = (early, (fetch or self._fetch)(keys, early))

    def prefetched(self, step: int) -> np.ndarray | None:
        """bool [len(plan.pull)]: the pulls of ``step`` :meth:`prefetch` started (not yet
        taken by :meth:`take`), or None."""
        got = self._started.get(step)
        return None if got is None else got[0]

    def take(self, step: int) -> tuple[np.ndarray | None, Callable[[], psio.Fetched] | None]:
        """``(bool [len(plan.pull)] mask, wait())`` of the pulls of ``step`` started early, then
        forgotten; ``(None, None)`` when none was."""
        return self._started.pop(step, (None, None))

    def forget(self) -> None:
        """Drop the pulls started and not taken yet (their replies are discarded on arrival)."""
        self._started.clear()

    def own_write_backs(self, mb: MicroBatch) -> np.ndarray | None:
        """bool [len(mb.plan.pull)]: the pulls not marked early whose key this worker wrote
        back at step ``mb.step - 1`` and does not hold now; None when there is none.

        NOTE [own write-backs]: the dispatcher marks a pull of step t + 1 "wait" when step t
        touches its key, but a key that worker w writes back at step t is touched at step t
        by that write-back only: w held its only latest copy, so no other worker could
        read, push or plan-push it at t (nor could w, having dropped it, unless it pulled it
        again: then w holds it and it is not taken here). w sent the write-back in
        ``PlanExecutor.evict`` of step t, before this pull, to the same shard over the same
        connection, and a shard serves one connection's requests in the order sent
        (ZeroMQ keeps a connection's order; ``ShardServer.serve`` handles one request at a
        time); so the pull reads the written-back row, as the serial protocol does. With
        one worker every "wait" pull of a key it does not hold is of this kind (step t's
        gradient and plan pushes are of keys it holds), so membership is checked only with
        several: alone, its pulls all leave while a step computes and none waits for a
        round trip on the critical path.
        """
        step, written = self._written_back
        if step is None or step != mb.step - 1 or not len(written):
            return None
        late = np.flatnonzero(~mb.pull_early)
        if not late.shape[0]:
            return None
        cand = KeySet(mb.plan.pull.table[late], mb.plan.pull.ids[late])
        ok = self.cache.slots(cand, must_exist=False) < 0
        if self.world_size > 1:  # alone, every key step t touches and this worker no longer holds is its write-back
            ok &= psio.member(cand, written)
        out = np.zeros(len(mb.plan.pull), bool)
        out[late[ok]] = True
        return out
