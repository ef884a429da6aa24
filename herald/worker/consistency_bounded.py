"""HET's per-embedding clock-bounded consistency on herald's plan-driven cache.

NOTE [bounded reads]
~~~~~~~~~~~~~~~~~~~~
HET (het-vldb22 §3.3 and §4.1) keeps a global clock c_g per embedding on the PS (NOTE
[embedding clocks] in herald/ps/table.py) and, per cached copy, its start clock c_s (c_g
when it was fetched) and current clock c_c (c_s plus the local updates since). A copy is
read while CheckValid holds::

    c_c <= c_s + s     and     c_g <= c_c + s

and re-fetched otherwise; Lemma 1: two replicas' clocks are then within 2s.

In herald the dispatcher's communication plan decides every pull, eviction and push
(NOTE [step protocol]); BSP pulls a cached copy exactly when it is stale (an
``update_pull``). :class:`Bounded` runs the BSP plan and relaxes only those reads: a pull
of a key that

1. this worker still caches (the plan refreshes a stale copy),
2. the worker sends as a gradient this step (``plan.grad_push``: its update goes to the
   PS, never into the stale row), and is not updated locally (``plan.update_local``),
3. is not prefetched (NOTE [early pulls]),

is asked for its c_g (a ``clocks`` request: 8 bytes per key instead of a row) and
skipped when CheckValid holds; the step then reads the cached copy, ``c_g - c_c`` updates
behind. That is where transmissions are saved (HET §4.1: only clocks travel on a valid
hit). Writes stay exact: gradients of shared keys are pushed every step and applied once
by the PS; the rows a worker alone updates (``update_local``) accumulate in its cache and
reach the PS only on eviction or when another worker needs them (Herald's plan push):
HET's stale writes, with the plan as the bound.

Read-my-updates (Het.Write, §3.3 Algorithm 3: "the data read by a client contains all its
own updates"). After pushing a shared key's gradient the worker also applies its own share
(the gradient divided by the number of workers, as pushed) to its cached copy with the
table's optimizer and adds 1 to c_c. A copy read stale then misses only the other workers'
updates, ``c_g - c_c`` of them by the clocks (each PS application and each own update
counts one, as in HET), and condition 1 re-fetches it after ``s`` own updates. Without it
(issue 13) a skipped copy stayed frozen at its fetch: the hottest keys, shared every
step, trained for up to ``s`` steps on gradients taken at that point, a delayed gradient
that made DeepFM on Avazu diverge at s = 4 (AUC 0.60 against BSP's 0.74). Such a copy
is a read cache only: the dispatcher counts it stale (the PS applied the aggregated
update), so it is never updated as the only latest copy (``update_local`` keys are always
pulled), never plan-pushed nor written back, and is dropped without write-back: the own
update reaches the PS once, inside the aggregated gradient; no update is lost or doubled,
and the scheduler's cache snapshots stay true.

Clocks: a pull sets c_s = c_c = c_g; a local update (``update_local`` or read-my-updates)
adds 1 to c_c; a plan push or a write-back sends c_c (the PS keeps max(c_g, c_c):
Het.Cache.Evict) and sets c_s = c_c.
The clock requests are acknowledged before the dense all-reduce, like every write
(NOTE [early pulls]), so the next step's reads see them.

``s = 0`` is exact BSP: CheckValid then needs c_g <= c_c, a latest copy, and the plan
only pulls stale ones, so nothing is skipped and no clock request is made
(tests/integration/test_train_exact.py runs ``--consistency bounded --staleness 0``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from herald.dispatch.microbatch import MicroBatch
from herald.scheduler.plan import CachePlan, KeySet
from herald.worker import psio
from herald.worker.executor import PlanExecutor, StepGrads, StepRows
from herald.worker.protocol import BSP, PROTOCOLS


def member(keys: KeySet, of: KeySet) -> np.ndarray:
    """bool [len(keys)]: whether each (table, id) of ``keys`` is in ``of``."""
    out = np.zeros(len(keys), bool)
    if not len(keys) or not len(of):
        return out
    other = {t: of.ids[m] for t, m in psio.table_groups(of.table)}
    for t, m in psio.table_groups(keys.table):
        if t in other:
            out[m] = np.isin(keys.ids[m], other[t])
    return out


def check_valid(c_s: np.ndarray, c_c: np.ndarray, c_g: np.ndarray, staleness: int) -> np.ndarray:
    """HET §4.1 CheckValid: bool [n], ``c_c <= c_s + s and c_g <= c_c + s`` (uint64 [n] clocks)."""
    s = np.uint64(staleness)
    return (c_c <= c_s + s) & (c_g <= c_c + s)


class Bounded(BSP):
    """HET clock-bounded reads over the BSP plan: NOTE [bounded reads].

    Args:
        executor: the worker's :class:`PlanExecutor`.
        staleness: the bound ``s`` (updates of one embedding); 0 is exact BSP.
    """

    name = "bounded"

    def __init__(self, executor: PlanExecutor, staleness: int = 0):
        super().__init__(executor)
        self.staleness = int(staleness)
        rows = executor.cache.capacity_rows
        self.start = np.zeros(rows, np.uint64)     # c_s per cache slot
        self.current = np.zeros(rows, np.uint64)   # c_c per cache slot
        self.known = np.zeros(rows, bool)          # c_s is a PS clock (else: c_s = 0, c_c = local updates)
        self._sync: list[tuple[KeySet, np.ndarray]] = []   # (written-back keys, their local updates)

    # ------------------------------------------------------ before forward
    def before_forward(self, mb: MicroBatch) -> None:
        ex, plan = self.executor, mb.plan
        if self.staleness == 0:   # exact BSP (see the NOTE): no clocks needed
            super().before_forward(mb)
            return
        wb = plan.write_back
        if wb.any():   # Het.Cache.Evict: the written-back copy's local updates go with it
            gone = KeySet(plan.evict.table[wb], plan.evict.ids[wb])
            slots = ex.cache.slots(gone)
            self._sync.append((gone, self.current[slots] - self.start[slots]))
        ex.evict(plan)
        pull = plan.pull
        slots = ex.cache.slots(pull, must_exist=False)
        shared = member(pull, plan.grad_push)
        cand = (slots >= 0) & shared & ~member(pull, plan.update_local) & ~mb.pull_early
        cand[cand] = self.known[slots[cand]]
        c_g = np.zeros(len(pull), np.uint64)   # of the candidates (CheckValid) and the shared rows fetched (c_s)
        if shared.any():
            with ex.timer("pull"):
                c_g[shared] = self._clocks_async(KeySet(pull.table[shared], pull.ids[shared]),
                                                 np.zeros(int(shared.sum()), np.uint64))()
        at = np.flatnonzero(cand)
        ok = check_valid(self.start[slots[at]], self.current[slots[at]], c_g[at], self.staleness)
        skip = np.zeros(len(pull), bool)
        skip[at[ok]] = True
        gaps = c_g[skip] - np.minimum(c_g[skip], self.current[slots[skip]])
        pulled = ex.pull(mb, keep=~skip)
        ex.pull_replicas(mb)
        self.count_reads(mb, gaps)
        self.stats["rereads"] += int((~ok).sum())
        if len(pulled):   # a fetch: c_s = c_c = c_g (known for the shared rows)
            got = ex.cache.slots(pulled)
            self.start[got] = self.current[got] = c_g[~skip]
            self.known[got] = shared[~skip]

    def _clocks_async(self, keys: KeySet, advance: np.ndarray):
        """Start a ``clocks`` request (NOTE [embedding clocks]): c_g += ``advance`` (uint64 [n]);
        returns ``wait()`` -> uint64 [n], c_g after (it also serves as a write handle)."""
        groups = dict(psio.table_groups(keys.table))
        handle = self.executor.ps.clocks_async({t: (keys.ids[m], advance[m]) for t, m in groups.items()})
        self.executor.bytes_pushed += 2 * keys.ids.nbytes    # keys and advances
        self.executor.bytes_pulled += keys.ids.nbytes        # clocks

        done: list[np.ndarray] = []

        def wait() -> np.ndarray:   # may be called again: the reply is kept
            if not done:
                got, out = handle.wait(), np.empty(len(keys), np.uint64)
                for t, m in groups.items():
                    out[m] = got[t]
                done.append(out)
            return done[0]

        wait.wait = wait   # a handle for PlanExecutor.track_write
        return wait

    # ------------------------------------------------------ after backward
    def after_backward(self, mb: MicroBatch, step_rows: StepRows) -> None:
        if self.staleness == 0:
            super().after_backward(mb, step_rows)
            return
        ex, plan = self.executor, mb.plan
        grads = ex.gradients(step_rows)
        ex.push_grads(mb, grads, step_rows)
        ex.update_local(plan, grads, step_rows)
        if len(plan.update_local):
            self.current[ex.cache.slots(plan.update_local)] += np.uint64(1)
        self._read_my_updates(plan, grads, step_rows)
        ex.push_plan(plan)
        ex.update_replicas(mb, grads, step_rows)
        self._send_syncs(plan.plan_push)
        ex.wait_writes()

    def _read_my_updates(self, plan: CachePlan, grads: StepGrads, step_rows: StepRows) -> None:
        """Het.Write (het-vldb22 §3.3, Algorithm 3): apply this worker's own gradient share to its
        cached copies of the keys it pushes as gradients (c_c += 1), so that a copy read stale
        later still holds the worker's own updates and misses only the other workers' (NOTE
        [bounded reads], "read-my-updates"). The PS applies the same gradient in the aggregated
        sum: these copies are stale in the plan and never written back, so nothing is applied
        twice. Keys updated locally anyway (``update_local``) or plan-pushed are left alone."""
        own = plan.grad_push
        if not len(own):
            return
        keep = ~member(own, plan.update_local) & ~member(own, plan.plan_push)
        own = KeySet(own.table[keep], own.ids[keep])
        if not len(own):
            return
        self.executor.update_local(dataclasses.replace(plan, update_local=own), grads, step_rows)
        self.current[self.executor.cache.slots(own)] += np.uint64(1)

    def flush(self, keys: KeySet, reset: bool) -> None:
        """The barrier's write-backs carry their local updates to the PS clocks too (:meth:`_send_syncs`)."""
        if self.staleness:
            self._send_syncs(keys)
            self.executor.wait_writes()
        super().flush(keys, reset)
        if reset:
            self.known[:] = False

    def _send_syncs(self, pushed: KeySet) -> None:
        """Het.Cache.Evict's clock sync for this step's write-backs and plan pushes: the PS adds
        the copy's local updates (c_c - c_s) to c_g, which is then max(c_g, c_c) (the copy was
        the only latest one: c_g = c_s on the PS); a plan-pushed copy stays cached with
        c_s = c_c = c_g. Acknowledged with the step's writes, before the all-reduce."""
        ex = self.executor
        slots = ex.cache.slots(pushed) if len(pushed) else np.zeros(0, np.int64)
        parts = self._sync + [(pushed, self.current[slots] - self.start[slots])]
        self._sync = []
        keys = KeySet(np.concatenate([k.table for k, _ in parts]), np.concatenate([k.ids for k, _ in parts]))
        if not len(keys):
            return
        wait = self._clocks_async(keys, np.concatenate([a for _, a in parts]))
        ex.track_write(wait)
        if len(pushed):
            n = len(pushed)

            def settle() -> None:   # the plan-pushed copies now hold c_g
                c_g = wait()[len(keys) - n:]
                self.start[slots] = self.current[slots] = c_g
                self.known[slots] = True

            settle.wait = settle
            ex.track_write(settle)


PROTOCOLS[Bounded.name] = Bounded
