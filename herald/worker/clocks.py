"""HET's clocks of one worker's cached copies, and the PS traffic that carries them.

NOTE [bounded reads] in herald/worker/consistency_bounded.py says what the clocks mean;
:class:`CopyClocks` keeps them for the bounded protocol (:class:`~herald.worker.
consistency_bounded.Bounded`) and carries out the clocked operations through the
:class:`~herald.worker.executor.PlanExecutor`, handing it the :data:`~herald.worker.executor.Fetch`
and :data:`~herald.worker.executor.Write` functions that send the clocks with the rows (a
conditional pull with c_c, write-backs and plan pushes with their local updates as an
``advance``: NOTE [clock frames] in herald/ps/wire.py). The executor moves rows and knows
no clock, so BSP's path carries none.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from herald.contracts.microbatch import MicroBatch
from herald.contracts.plan import CachePlan, KeySet
from herald.errors import DataError, ProtocolError
from herald.ps import PSClient
from herald.ps.wire import valid_copies
from herald.worker import psio
from herald.worker.executor import PlanExecutor
from herald.worker.psio import member
from herald.worker.rows import Fetch, Write


def check_valid(c_s: np.ndarray, c_c: np.ndarray, c_g: np.ndarray, staleness: int) -> np.ndarray:
    """HET §4.1 CheckValid: bool [n], ``c_c <= c_s + s and c_g <= c_c + s`` (uint64 [n] clocks):
    :func:`fresh_enough` (the worker's half) and the shard's :func:`~herald.ps.wire.valid_copies`."""
    return fresh_enough(c_s, c_c, staleness) & valid_copies(c_c, c_g, staleness)


def fresh_enough(c_s: np.ndarray, c_c: np.ndarray, staleness: int) -> np.ndarray:
    """CheckValid's first condition, checked on the worker: bool [n], ``c_c <= c_s + s``."""
    return c_c <= c_s + np.uint64(staleness)


def advancing(ps: PSClient, advance: np.ndarray | None, read_clocks: bool = False) -> Write:
    """A :data:`~herald.worker.executor.Write` whose rows advance their PS clocks by ``advance``
    (uint64 [n], the copies' local updates; None: a plain write); with ``read_clocks`` its
    handle's ``wait()`` gives c_g after (uint64 [n]): :func:`herald.worker.psio.push_rows_async`."""
    return lambda keys, rows: psio.push_rows_async(ps, keys, rows, advance, read_clocks)


class CopyClocks:
    """c_s and c_c of every cached copy of one worker, and the clocked PS operations (NOTE
    [bounded reads]: "Clocks").

    Args:
        executor: the worker's :class:`~herald.worker.executor.PlanExecutor` (its cache's slots index the clocks).
        staleness: the bound ``s`` >= 1 (updates of one embedding).

    Attributes:
        start, current: uint64 [cache rows]: c_s and c_c per cache slot.
        known: bool [cache rows]: c_s is a PS clock (else c_s = 0, c_c = the local updates).

    Raises:
        ProtocolError: from :meth:`pull`, a checked pull that was prefetched, or a shared
            one prefetched without its clock (a bug of the protocol).
    """

    def __init__(self, executor: PlanExecutor, staleness: int):
        self.executor, self.staleness = executor, int(staleness)
        rows = executor.cache.capacity_rows
        self.start = np.zeros(rows, np.uint64)
        self.current = np.zeros(rows, np.uint64)
        self.known = np.zeros(rows, bool)
        self._prefetched: dict[int, np.ndarray] = {}  # step -> the pulls prefetched with their clock

    def arrays(self) -> dict[str, np.ndarray]:
        """c_s, c_c and known per cache slot, copies (NOTE [warm resume] in herald/dispatch/warm.py)."""
        return {
            "clock_start": self.start.copy(),
            "clock_current": self.current.copy(),
            "clock_known": self.known.copy(),
        }

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Take back :meth:`arrays` of a cache of as many rows.

        Raises:
            DataError: missing clocks or other shapes (a cache saved under another mode).
        """
        mine = self.arrays()
        if set(arrays) != set(mine) or any(np.shape(arrays[k]) != v.shape for k, v in mine.items()):
            raise DataError("a saved worker cache has no clocks of this cache's rows; resume with the same --staleness")
        self.start = arrays["clock_start"].astype(np.uint64).copy()
        self.current = arrays["clock_current"].astype(np.uint64).copy()
        self.known = arrays["clock_known"].astype(bool).copy()

    def _local_updates(self, slots: np.ndarray) -> np.ndarray:
        """uint64 [n]: c_c - c_s of the copies in ``slots``: what a write of them advances."""
        return self.current[slots] - self.start[slots]

    def _fetch(self, clocked: np.ndarray, checked: np.ndarray | None = None, c_c: np.ndarray | None = None) -> Fetch:
        """The :data:`~herald.worker.executor.Fetch` of a conditional pull: the pulls ``clocked``
        (bool [len(plan.pull)]) with their c_g, those ``checked`` with their copy's ``c_c``."""
        ex, s = self.executor, self.staleness

        def fetch(keys: KeySet, at: np.ndarray) -> Callable[[], psio.Fetched]:
            mine = (None, None) if checked is None else (checked[at], c_c[at])
            return psio.fetch_async(ex.ps, keys, ex.cache.row_width, clocked[at], *mine, s)

        return fetch

    def local_updates(self, keys: KeySet) -> None:
        """The cached copies of ``keys`` were updated once more locally: c_c += 1."""
        if len(keys):
            self.current[self.executor.cache.slots(keys)] += np.uint64(1)

    def prefetch(self, mb: MicroBatch) -> None:
        """The early pulls of ``mb`` (NOTE [early pulls]), those of shared keys with their clocks."""
        clocked = member(mb.plan.pull, mb.plan.grad_push)
        self._prefetched[mb.step] = clocked
        self.executor.early.prefetch(mb, fetch=self._fetch(clocked))

    def evict(self, plan: CachePlan, step: int) -> None:
        """The plan's evictions: a written-back copy's local updates go with it (Het.Cache.Evict)."""
        ex, wb = self.executor, plan.write_back
        advance = None
        if wb.any():
            advance = self._local_updates(ex.cache.slots(KeySet(plan.evict.table[wb], plan.evict.ids[wb])))
        ex.evict(plan, step, write=advancing(ex.ps, advance))

    def pull(self, mb: MicroBatch) -> tuple[np.ndarray, int]:
        """The plan's pulls, a copy that passes CheckValid read instead (NOTE [bounded reads]).

        Returns:
            ``(gaps, rereads)``: uint64 clock gaps (updates behind) of the copies read stale,
            and the checked copies re-fetched because the bound was reached.
        """
        ex, plan = self.executor, mb.plan
        pull = plan.pull
        slots = ex.cache.slots(pull, must_exist=False)
        shared = member(pull, plan.grad_push)
        cand = (slots >= 0) & shared & ~member(pull, plan.update_local) & ~mb.pull_early
        cand[cand] = self.known[slots[cand]]
        at = np.flatnonzero(cand)  # CheckValid's first condition is local; the shard checks the second
        checked = np.zeros(len(pull), bool)
        checked[at[fresh_enough(self.start[slots[at]], self.current[slots[at]], self.staleness)]] = True
        c_c = np.zeros(len(pull), np.uint64)
        c_c[checked] = self.current[slots[checked]]
        self._check_prefetched(mb.step, shared, checked)
        got = ex.pull(mb, fetch=self._fetch(shared, checked, c_c))
        skip = ~got.fetched
        c_g = got.clocks
        gaps = c_g[skip] - np.minimum(c_g[skip], self.current[slots[skip]])
        if len(got.keys):  # a fetch: c_s = c_c = c_g (known for the shared rows)
            fetched = ex.cache.slots(got.keys)
            self.start[fetched] = self.current[fetched] = c_g[got.fetched]
            self.known[fetched] = shared[got.fetched]
        return gaps, int(at.shape[0] - skip.sum())

    def _check_prefetched(self, step: int, shared: np.ndarray, checked: np.ndarray) -> None:
        """A prefetched pull is always fetched, with its clock when shared (ProtocolError otherwise)."""
        early = self.executor.early.prefetched(step)
        clocked = self._prefetched.pop(step, None)
        self._prefetched = {s: m for s, m in self._prefetched.items() if s > step}
        if early is None:
            return
        clocked = np.zeros(len(early), bool) if clocked is None else clocked
        if checked[early].any() or (shared & ~clocked)[early].any():
            raise ProtocolError(
                f"step {step}: a relaxed protocol checked a prefetched pull, or asked the clock "
                "of one prefetched without it (a bug of the protocol: prefetch the shared pulls "
                "with their clocks; a pull_early key is always fetched)"
            )

    def push_plan(self, plan: CachePlan) -> None:
        """The plan pushes with their local updates (Het.Cache.Evict's clock sync); once they
        are acknowledged (:meth:`~herald.worker.executor.PlanExecutor.wait_writes`) the copies
        hold c_g: c_s = c_c = c_g."""
        ex, pushed = self.executor, plan.plan_push
        slots = ex.cache.slots(pushed) if len(pushed) else np.zeros(0, np.int64)
        wait = ex.push_plan(plan, write=advancing(ex.ps, self._local_updates(slots), read_clocks=True))
        if wait is None:
            return

        def settle() -> None:
            self.start[slots] = self.current[slots] = wait()
            self.known[slots] = True

        settle.wait = settle
        ex.track_write(settle)

    def flush(self, keys: KeySet, reset: bool) -> None:
        """The barrier's write-backs carry their local updates to the PS clocks too (NOTE
        [clock frames]); kept copies then hold c_s = c_c = c_g."""
        ex = self.executor
        slots = ex.cache.slots(keys) if len(keys) else np.zeros(0, np.int64)
        c_g = ex.flush(keys, reset, write=advancing(ex.ps, self._local_updates(slots), read_clocks=not reset))
        self._prefetched.clear()
        if reset:
            self.known[:] = False
        elif c_g is not None:
            self.start[slots] = self.current[slots] = c_g
            self.known[slots] = True
