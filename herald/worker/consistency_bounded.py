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

from herald.contracts.microbatch import MicroBatch
from herald.contracts.modes import BoundedSettings
from herald.contracts.plan import CachePlan, KeySet
from herald.worker.clocks import CopyClocks
from herald.worker.executor import PlanExecutor
from herald.worker.protocol import BSP
from herald.worker.psio import member
from herald.worker.rows import StepGrads, StepRows


class Bounded(BSP):
    """HET clock-bounded reads over the BSP plan: NOTE [bounded reads]. The copies' clocks
    and the clocked PS operations are its collaborator's, :class:`~herald.worker.clocks.CopyClocks`.

    Args:
        executor: the worker's :class:`PlanExecutor`.
        staleness: the bound ``s`` (updates of one embedding); 0 is exact BSP (no clocks).
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
        self.clocks = CopyClocks(executor, self.staleness) if self.staleness else None

    def warm_arrays(self) -> dict:
        """The copies' clocks (NOTE [warm resume] in herald/dispatch/warm.py)."""
        return {} if self.clocks is None else self.clocks.arrays()

    def load_warm_arrays(self, arrays: dict) -> None:
        if self.clocks is not None:
            self.clocks.load_arrays(arrays)

    # ------------------------------------------------------ before forward
    def prefetch(self, mb: MicroBatch) -> None:
        """The early pulls (NOTE [early pulls]), those of shared keys with their clocks."""
        if self.clocks is None:
            super().prefetch(mb)
        else:
            self.clocks.prefetch(mb)

    def before_forward(self, mb: MicroBatch) -> None:
        if self.clocks is None:  # exact BSP (see the NOTE): no clocks needed
            super().before_forward(mb)
            return
        self.clocks.evict(mb.plan, mb.step)
        gaps, rereads = self.clocks.pull(mb)
        self.executor.pull_replicas(mb)
        self.count_reads(mb, gaps)
        self.stats["rereads"] += rereads

    # ------------------------------------------------------ after backward
    def after_backward(self, mb: MicroBatch, step_rows: StepRows) -> None:
        if self.clocks is None:
            super().after_backward(mb, step_rows)
            return
        ex, plan = self.executor, mb.plan
        grads = ex.gradients(step_rows)
        ex.push_grads(mb, grads, step_rows)
        ex.update_local(plan, grads, step_rows)
        self.clocks.local_updates(plan.update_local)
        self._read_my_updates(plan, grads, step_rows)
        self.clocks.push_plan(plan)
        ex.update_replicas(mb, grads, step_rows)
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
        self.clocks.local_updates(own)

    def flush(self, keys: KeySet, reset: bool) -> None:
        """The barrier's write-backs carry their local updates to the PS clocks too (NOTE
        [clock frames]; :meth:`~herald.worker.clocks.CopyClocks.flush`)."""
        if self.clocks is None:
            super().flush(keys, reset)
        else:
            self.clocks.flush(keys, reset)
