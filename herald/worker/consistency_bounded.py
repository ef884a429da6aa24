"""HET's per-embedding clock-bounded consistency on herald's plan-driven cache.

NOTE [bounded reads]
~~~~~~~~~~~~~~~~~~~~
HET keeps a global clock c_g per embedding on the PS (HET §3.3 and §4.1; NOTE
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

is *checked*: CheckValid's first condition is local, and a copy that passes it goes in a
conditional pull with its c_c (NOTE [clock frames] in herald/ps/wire.py), where the shard
evaluates the second condition and sends the row only if it fails; otherwise only c_g
comes back and the step reads the cached copy, ``c_g - c_c`` updates behind. That is
where transmissions are saved (HET §4.1: only clocks travel on a valid hit), in the one
round trip of the pull itself. The other shared pulls travel in the same conditional
pull without a c_c (always fetched: their c_g becomes the new copy's c_s); pulls of keys
not shared are plain pulls. Writes stay exact: gradients of shared keys are pushed every step and applied once
by the PS; the rows a worker alone updates (``update_local``) accumulate in its cache and
reach the PS only on eviction or when another worker needs them (Herald's plan push):
HET's stale writes, with the plan as the bound.

Read-my-updates (Het.Write, HET §3.3, Alg. 3: "the data read by a client contains all its
own updates"). After pushing a shared key's gradient the worker also applies its own share
(the gradient divided by the number of workers, as pushed) to its cached copy with the
table's optimizer and adds 1 to c_c. A copy read stale then misses only the other workers'
updates, ``c_g - c_c`` of them by the clocks (each PS application and each own update
counts one, as in HET), and condition 1 re-fetches it after ``s`` own updates. Without it
a skipped copy stayed frozen at its fetch: the hottest keys, shared every
step, trained for up to ``s`` steps on gradients taken at that point, a delayed gradient
that made DeepFM on Avazu diverge at s = 4 (AUC 0.60 against BSP's 0.74; docs/consistency.md,
"bounded (HET)"). Such a copy
is a read cache only: the dispatcher counts it stale (the PS applied the aggregated
update), so it is never updated as the only latest copy (``update_local`` keys are always
pulled), never plan-pushed nor written back, and is dropped without write-back: the own
update reaches the PS once, inside the aggregated gradient; no update is lost or doubled,
and the scheduler's cache snapshots stay true.

Clocks: a pull of a shared key sets c_s = c_c = c_g (a key pulled without its clock has
no known c_s, c_s = 0, and is never checked); a local update (``update_local`` or
read-my-updates) adds 1 to c_c; a write-back or plan push carries the copy's local updates
c_c - c_s on its ``push_rows`` (an ``advance`` frame: the PS adds them, which is
Het.Cache.Evict's max(c_g, c_c) as the copy was the only latest one), and a plan-pushed
copy takes the c_g of the reply as c_s = c_c (it is then known). Write-backs travel with
the step's other writes and are acknowledged before the dense all-reduce (NOTE [early
pulls]), so the next step's reads see them; since a write-back's advance rides on it, the
worker's own write-backs may be prefetched for the next step as under BSP (NOTE [own
write-backs]), their shared keys with their clocks (:meth:`Bounded.prefetch`).

``s = 0`` is exact BSP: CheckValid then needs c_g <= c_c, a latest copy, and the plan
only pulls stale ones, so nothing is skipped and no clock travels
(tests/integration/test_train_exact.py runs ``--consistency bounded --staleness 0``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from herald.contracts.modes import BoundedSettings
from herald.dispatch.microbatch import MicroBatch
from herald.ps.wire import valid_copies
from herald.scheduler.plan import CachePlan, KeySet
from herald.worker.executor import PlanExecutor, StepGrads, StepRows
from herald.worker.protocol import BSP
from herald.worker.psio import member


def check_valid(c_s: np.ndarray, c_c: np.ndarray, c_g: np.ndarray, staleness: int) -> np.ndarray:
    """HET §4.1 CheckValid: bool [n], ``c_c <= c_s + s and c_g <= c_c + s`` (uint64 [n] clocks):
    :func:`fresh_enough` (the worker's half) and the shard's :func:`~herald.ps.wire.valid_copies`."""
    return fresh_enough(c_s, c_c, staleness) & valid_copies(c_c, c_g, staleness)


def fresh_enough(c_s: np.ndarray, c_c: np.ndarray, staleness: int) -> np.ndarray:
    """CheckValid's first condition, checked on the worker: bool [n], ``c_c <= c_s + s``."""
    return c_c <= c_s + np.uint64(staleness)


class Bounded(BSP):
    """HET clock-bounded reads over the BSP plan: NOTE [bounded reads].

    Args:
        executor: the worker's :class:`PlanExecutor`.
        staleness: the bound ``s`` (updates of one embedding); 0 is exact BSP.
    """

    name = BoundedSettings.name

    @classmethod
    def for_settings(cls, executor: PlanExecutor, settings: BoundedSettings) -> Bounded:
        return cls(executor, staleness=settings.staleness)

    def __init__(self, executor: PlanExecutor, staleness: int = 0):
        super().__init__(executor)
        self.staleness = int(staleness)
        self.step_messages = (
            self.staleness == 0
        )  # relaxed reads: the all-reduce orders the writes (NOTE [step protocol])
        rows = executor.cache.capacity_rows
        self.start = np.zeros(rows, np.uint64)  # c_s per cache slot
        self.current = np.zeros(rows, np.uint64)  # c_c per cache slot
        self.known = np.zeros(rows, bool)  # c_s is a PS clock (else: c_s = 0, c_c = local updates)

    # ------------------------------------------------------ before forward
    def prefetch(self, mb: MicroBatch) -> None:
        """The early pulls (NOTE [early pulls]), those of shared keys with their clocks."""
        if self.staleness == 0:
            super().prefetch(mb)
        else:
            self.executor.prefetch(mb, clocked=member(mb.plan.pull, mb.plan.grad_push))

    def before_forward(self, mb: MicroBatch) -> None:
        ex, plan = self.executor, mb.plan
        if self.staleness == 0:  # exact BSP (see the NOTE): no clocks needed
            super().before_forward(mb)
            return
        wb = plan.write_back
        advance = None
        if wb.any():  # Het.Cache.Evict: the written-back copy's local updates go with it
            slots = ex.cache.slots(KeySet(plan.evict.table[wb], plan.evict.ids[wb]))
            advance = self.current[slots] - self.start[slots]
        ex.evict(plan, mb.step, advance)
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
        got = ex.pull(mb, clocked=shared, checked=checked, c_c=c_c, staleness=self.staleness)
        skip = ~got.fetched
        c_g = got.clocks
        gaps = c_g[skip] - np.minimum(c_g[skip], self.current[slots[skip]])
        ex.pull_replicas(mb)
        self.count_reads(mb, gaps)
        self.stats["rereads"] += int(at.shape[0] - skip.sum())
        if len(got.keys):  # a fetch: c_s = c_c = c_g (known for the shared rows)
            fetched = ex.cache.slots(got.keys)
            self.start[fetched] = self.current[fetched] = c_g[got.fetched]
            self.known[fetched] = shared[got.fetched]

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
        pushed = plan.plan_push
        slots = ex.cache.slots(pushed) if len(pushed) else np.zeros(0, np.int64)
        wait = ex.push_plan(plan, self.current[slots] - self.start[slots])  # Het.Cache.Evict's clock sync
        ex.update_replicas(mb, grads, step_rows)
        if wait is not None:

            def settle() -> None:  # the plan-pushed copies now hold c_g: c_s = c_c = c_g
                self.start[slots] = self.current[slots] = wait()
                self.known[slots] = True

            settle.wait = settle
            ex.track_write(settle)
        ex.wait_writes()

    def _read_my_updates(self, plan: CachePlan, grads: StepGrads, step_rows: StepRows) -> None:
        """Het.Write (HET §3.3, Alg. 3): apply this worker's own gradient share to its
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
        """The barrier's write-backs carry their local updates to the PS clocks too (NOTE
        [clock frames]); kept copies then hold c_s = c_c = c_g."""
        if not self.staleness:
            super().flush(keys, reset)
            return
        slots = self.executor.cache.slots(keys) if len(keys) else np.zeros(0, np.int64)
        c_g = self.executor.flush(keys, reset, self.current[slots] - self.start[slots])
        if reset:
            self.known[:] = False
        elif c_g is not None:
            self.start[slots] = self.current[slots] = c_g
            self.known[slots] = True
