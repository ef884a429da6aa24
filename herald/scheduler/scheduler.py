"""The scheduler front class: allocation, cache snapshots, communication plan, accounting.

Pipeline (Herald §4.2, Fig. 9): ``submit(batch of step t+1)`` allocates it on the
snapshots left by step ``t``, derives step ``t``'s plan pushes from that allocation
(Herald Alg. 2), then runs step ``t+1``'s before-forward (evict, pull) and after-backward
(grad push, local update) parts on the snapshots, and returns the finished plan of
step ``t``. Worker caches executing the plans in NOTE [step protocol]
(:mod:`herald.contracts.plan`) equal the snapshots by construction.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from herald.config import require
from herald.contracts.plan import CAUSES, KeySet
from herald.errors import ConfigError, DataError, HeraldError
from herald.scheduler import kernels as K
from herald.scheduler import step_kernels as STK
from herald.scheduler.allocation import Allocator
from herald.scheduler.batch_keys import sample_csr
from herald.scheduler.budget import BudgetController
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.parallel import ParallelPasses
from herald.scheduler.plan_build import build_plans
from herald.scheduler.saved_state import check_scheduler_state, scheduler_state
from herald.scheduler.state import Snapshots
from herald.scheduler.warm import Pending, pack, scheduler_part, unpack


def cache_capacity(config: SchedulerConfig, distinct_keys: int | None) -> int:
    """Rows per worker cache: ``config.cache_capacity_rows``, else ``ceil(cache_ratio * distinct_keys)``.

    Raises:
        ConfigError: neither is given, or ``distinct_keys`` < 1.
    """
    if config.cache_capacity_rows is not None:
        return int(config.cache_capacity_rows)
    if distinct_keys is not None:
        require(distinct_keys >= 1, f"distinct_keys must be >= 1, got {distinct_keys}")
        return int(max(1, math.ceil(config.cache_ratio * distinct_keys)))
    raise ConfigError(
        "cannot size the worker caches: pass distinct_keys (e.g. from "
        "herald.loader.splits.count_distinct_keys over a pre-pass) to use cache_ratio, "
        "or set cache_capacity_rows"
    )


@dataclasses.dataclass
class StepPlan:
    """Everything the workers need for one step.

    Attributes:
        step: step index (0-based, in submit order).
        assignment: per worker, int64 [batch_size_per_worker] indices into that step's
            global batch, ascending.
        plans: per worker, its :class:`CachePlan` (empty list when the scheduler was
            built with ``build_plans=False``).
        counts: int64 [num_workers, len(CAUSES)] transmissions by cause.
    """

    step: int
    assignment: list
    plans: list
    counts: np.ndarray


def _check_before_forward(err: np.ndarray, off: np.ndarray, step: int, capacity_rows: int) -> None:
    """Raise what the before-forward pass's ``err`` (int64 [2]: code, worker) reports.

    Raises:
        ConfigError: code 1, a worker's keys do not fit its cache. HeraldError: code 2.
    """
    if err[0] == 1:
        w = int(err[1])
        raise ConfigError(
            f"worker {w} needs {int(off[w + 1] - off[w])} distinct keys in step "
            f"{step} but its cache holds {capacity_rows} rows: "
            "use a bigger cache (cache_capacity_rows / cache_ratio) or a smaller "
            "batch_size_per_worker"
        )
    if err[0] == 2:  # pragma: no cover - would be a scheduler bug
        raise HeraldError(
            f"protocol violation: worker {int(err[1])} must pull a key whose latest "
            "copy is not at the PS (NOTE [step protocol])"
        )


class Scheduler:
    """Herald's embedding scheduler (Herald §3-§4, Alg. 1, 2) under BSP (NOTE [step protocol]).

    Args:
        config: :class:`SchedulerConfig`.
        num_tables: T, tables of every submitted batch (<= 32767).
        distinct_keys: keys expected over the run; with ``cache_ratio`` gives the capacity
            ``ceil(cache_ratio * distinct_keys)``. Not needed when
            ``config.cache_capacity_rows`` is set. If both are missing, raises
            :class:`ConfigError` (a capacity cannot change once workers allocated caches).
        build_plans: materialise :class:`CachePlan` objects (the dispatcher needs them;
            simulations only need counts).
        budget: the :class:`BudgetController` of adaptive LAIA to use, shared by the
            successive schedulers of one job so that k and its history carry over
            (``config.scheduling_budget_ms`` must be set); None: one is made from the
            config when it sets a budget.

    Raises:
        ConfigError: no capacity can be derived, ``num_tables`` is out of range, a
            ``budget`` without ``scheduling_budget_ms`` or for another table count, or
            more ``threads`` than numba's thread pool.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        num_tables: int,
        distinct_keys: int | None = None,
        *,
        build_plans: bool = True,
        budget: BudgetController | None = None,
        feature_tables: Sequence[int] | None = None,
    ) -> None:
        require(isinstance(config, SchedulerConfig), "config must be a SchedulerConfig")
        require(1 <= num_tables <= 32767, f"num_tables must be in 1..32767, got {num_tables}")
        self.config = config
        self.num_tables = num_tables
        # NOTE [tables and features] (herald/contracts/features.py): a key is (table, id), and
        # features sharing a table share its keys; None: feature t reads table t
        self.feature_tables = None if feature_tables is None else np.asarray(feature_tables, np.int16)
        require(
            self.feature_tables is None
            or bool(
                self.feature_tables.ndim == 1
                and ((self.feature_tables >= 0) & (self.feature_tables < num_tables)).all()
            ),
            f"feature_tables must index the {num_tables} tables",
        )
        self.num_features = num_tables if self.feature_tables is None else int(self.feature_tables.shape[0])
        self.capacity_rows = cache_capacity(config, distinct_keys)
        self.build_plans = build_plans
        W = config.num_workers
        # with distinct_keys known, reserve the key state once (no regrowth while scheduling)
        self._snap = Snapshots(
            W,
            self.capacity_rows,
            config.cache_policy,
            initial_slots=int(distinct_keys) + 1024 if distinct_keys else 1 << 10,
        )
        self._pending: Pending | None = None
        self._next_step = 0
        self._finished = False
        self._used = False  # submit() was called (load_state_dict only on an unused scheduler)
        self._in_flight = False  # submitted and not yet finish() + flush(): state_dict() raises
        self._totals = np.zeros((W, len(CAUSES)), np.int64)
        # Herald §4.4: the passes on config.threads threads (plans identical to one thread)
        self._par = ParallelPasses(config.threads) if config.threads > 1 else None
        self._alloc = Allocator(config, num_tables, self._par, budget)
        #: seconds spent in each submit() (scheduling time per global batch).
        self.submit_seconds: list[float] = []
        self._samples_seen = 0

    # ------------------------------------------------------------------ public
    @property
    def snapshots(self) -> Snapshots:
        """The cache snapshots (read-only use)."""
        return self._snap

    @property
    def num_scored_tables(self) -> int:
        """k: the tables the next allocation scores (adaptive LAIA; ``num_tables`` when static)."""
        return self._alloc.num_scored_tables

    @property
    def table_doi(self):
        """float64 [T]: degree of infrequency per table (adaptive LAIA), or None when static."""
        profiler = self._alloc.profiler
        return None if profiler is None else profiler.doi.copy()

    def scored_tables(self) -> np.ndarray:
        """bool [T]: tables the next allocation scores (all for static LAIA)."""
        return self._alloc.table_mask().copy()

    def totals(self) -> np.ndarray:
        """int64 [num_workers, len(CAUSES)]: counts accumulated over finished steps."""
        return self._totals.copy()

    def stats(self) -> dict:
        """JSON-able: ``threads``, ``lock_free_allocation``, ``num_tables``,
        ``num_scored_tables`` (k of the next step), ``submit_ms_median`` (None before any
        step) and ``adaptive``: the budget controller's :meth:`BudgetController.stats`
        (k over time, ``budget_unreachable``), or None without a budget."""
        sub = self.submit_seconds
        budget = self._alloc.budget
        return {
            "threads": self.config.threads,
            "lock_free_allocation": self.config.lock_free_allocation,
            "num_tables": self.num_tables,
            "num_scored_tables": int(self.num_scored_tables),
            "submit_ms_median": 1e3 * float(np.median(sub)) if sub else None,
            "adaptive": budget.stats() if budget is not None else None,
        }

    def submit(self, batch) -> StepPlan | None:
        """Schedule ``batch`` as step t+1 and return the finished plan of step t (None first).

        Args:
            batch: SampleBatch of exactly ``num_workers * batch_size_per_worker`` samples
                and ``num_tables`` tables.

        Raises:
            DataError: wrong batch size or table count.
            ConfigError: a micro-batch uses more distinct keys than ``capacity_rows``
                (fix: a bigger cache or smaller micro-batches).
            HeraldError: called after :meth:`finish`.

        The batch checks run before any state changes; after a ConfigError raised by a
        step the snapshots are partially updated: discard the scheduler.
        """
        t0 = time.perf_counter()
        self._check_batch(batch)
        self._used = self._in_flight = True
        self._snap.renew_tokens()
        if self._par is not None:
            self._par.enter()
        samp_off, samp_slot, samp_tab = sample_csr(batch, self._snap, self._par, self.feature_tables)
        table_on = self._alloc.table_mask()
        ta = time.perf_counter()
        worker_of = self._alloc.allocate(samp_off, samp_slot, samp_tab, table_on, self._snap)
        alloc_s = time.perf_counter() - ta
        W = self.config.num_workers
        order = np.empty(worker_of.shape[0], np.int64)
        wstart = np.empty(W + 1, np.int64)  # = Bw * arange(W + 1): every worker gets Bw samples
        STK.group_by_worker_jit(worker_of, order, wstart)
        prev = self._pending
        keys, off, pp = self._collect_keys(samp_off, samp_slot, order, wstart, prev is not None)
        self._pending = self._run_step(worker_of, order, keys, off)
        self._samples_seen += self.config.batch_size_per_worker
        done = self._finalize(prev, pp) if prev is not None else None
        total_s = time.perf_counter() - t0
        self.submit_seconds.append(total_s)
        self._alloc.after_step(self._snap, self._samples_seen, alloc_s, total_s, t0)
        return done

    def finish(self) -> StepPlan | None:
        """Finish the last submitted step (no plan pushes: there is no next step)."""
        self._finished = True
        if self._par is not None:
            self._par.enter()
        prev, self._pending = self._pending, None
        return self._finalize(prev, None) if prev is not None else None

    def flush(self) -> list:
        """Per worker, a :class:`KeySet` of keys whose only latest copy is in its cache.

        Call after :meth:`finish`: the trainer writes these rows back to the PS so that
        the PS holds the final model. The snapshots then record the PS copy as latest.
        """
        s = self._snap
        n = s.num_keys
        owner = s.owner[:n]
        out = []
        for w in range(self.config.num_workers):
            idx = np.flatnonzero(owner == w)
            out.append(KeySet(s.slot_tab[idx].astype(np.int32), s.slot_ids[idx]))
        owner[owner >= 0] = -1
        if self._finished:
            self._in_flight = False
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The scheduler's state at a checkpoint barrier (JSON-able; between them: :meth:`warm_state`).

        NOTE [scheduler state]: the cache snapshots are *not* serialised. The state is
        complete only where they carry nothing forward: before the first :meth:`submit`,
        or after :meth:`finish` + :meth:`flush` at a checkpoint barrier, where the
        workers empty their caches and the job goes on with a fresh scheduler (NOTE
        [checkpoint barrier] in :mod:`herald.dispatch.dispatcher`). It describes that
        fresh scheduler: ``{"format": "scheduler", "config": SchedulerConfig fields,
        "num_tables", "capacity_rows", "next_step", "totals": int [W][len(CAUSES)]}``;
        a scheduler given it by :meth:`load_state_dict` starts with empty snapshots and
        the seed's RNG, numbers its steps from ``next_step`` and keeps the totals.

        Raises:
            HeraldError: steps are in flight (submitted and not yet finished and flushed).
        """
        if self._in_flight:
            raise HeraldError(
                "Scheduler.state_dict() is valid only at a checkpoint barrier (NOTE [scheduler "
                "state]): call finish() and flush() first; the cache snapshots are not serialised"
            )
        return scheduler_state(self.config, self.num_tables, self.capacity_rows, self._next_step, self._totals)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`state_dict`; NOTE [scheduler state]) on a
        scheduler that has not scheduled anything yet.

        Raises:
            DataError: malformed state. ConfigError: saved with another configuration,
                table count or capacity (build this scheduler with the same settings).
            HeraldError: this scheduler already scheduled a batch.
        """
        if self._used:
            raise HeraldError(
                "Scheduler.load_state_dict() needs a fresh scheduler (nothing submitted); create a new Scheduler"
            )
        self._next_step, self._totals = check_scheduler_state(
            state, self.config, self.num_tables, self.capacity_rows, self._totals.shape
        )

    def warm_state(self) -> tuple[dict, dict]:
        """``(meta JSON-able, arrays by name)``: all it carries into the next step (herald/scheduler/
        warm.py; NOTE [warm resume] in herald/dispatch/warm.py). Take it before :meth:`finish`.

        Raises:
            HeraldError: no step is pending (nothing submitted, or :meth:`finish` called).
        """
        if self._pending is None:
            raise HeraldError("Scheduler.warm_state() needs a submitted step not yet finished: call it before finish()")
        state = scheduler_state(self.config, self.num_tables, self.capacity_rows, self._next_step, self._totals)
        return pack(state, self._pending, self._samples_seen, self._snap, self._alloc)

    def load_warm_state(self, meta: dict, arrays: dict) -> None:
        """Continue from :meth:`warm_state` on an unused scheduler: the next :meth:`submit`
        returns the plan of the saved pending step, trained already (herald/scheduler/warm.py).

        Raises:
            DataError: malformed state. ConfigError: saved with another configuration,
                table count or capacity. HeraldError: this scheduler already scheduled a batch.
        """
        self.load_state_dict(scheduler_part(meta))
        self._pending, self._samples_seen = unpack(meta, arrays, self._snap, self._alloc)
        self._used = self._in_flight = True

    # ------------------------------------------------------------------ parts
    def _check_batch(self, batch) -> None:
        """Raise before any state changes when ``batch`` cannot be step t+1 (see :meth:`submit`)."""
        if self._finished:
            raise HeraldError(
                "submit() after finish(): the final step has no plan pushes; create a new Scheduler for a new run"
            )
        cfg = self.config
        if len(batch) != cfg.global_batch_size:
            raise DataError(
                f"global batch must have num_workers*batch_size_per_worker="
                f"{cfg.global_batch_size} samples, got {len(batch)}; use drop_last or pad upstream"
            )
        if batch.num_tables != self.num_features:
            raise DataError(f"batch has {batch.num_tables} tables, scheduler was built for {self.num_features}")

    def _collect_keys(self, samp_off, samp_slot, order, wstart, has_prev: bool):
        """One pass: K_w of every worker in canonical order (``keys`` int32 [nnz'] at ``off``
        int64 [W+1]) and step t's plan pushes (Herald Alg. 2, same order): ``(pp_slot, pp_w)``
        int32 [P] each, or None without a previous step or under full-set sync."""
        cfg, s = self.config, self._snap
        W, nnz = cfg.num_workers, samp_slot.shape[0]
        keys = np.empty(nnz, np.int32)
        off = np.empty(W + 1, np.int64)
        pp_slot = np.empty(nnz, np.int32)
        pp_w = np.empty(nnz, np.int32)
        plan_push = has_prev and not cfg.full_sync
        count_freq = self._alloc.profiler is not None
        clear_use = cfg.allocation == "costaware"
        batch, out, flags = (
            (samp_off, samp_slot, order, wstart),
            (keys, off, pp_slot, pp_w),
            (count_freq, clear_use, plan_push),
        )
        if self._par is not None:
            c = self._par.collect_keys(batch, s, *flags, out)
        else:
            c = STK.collect_keys_jit(batch, s.mark, s.token, s.use_mask, s.freq, s.owner, *flags, out)
        return keys[: off[-1]], off, ((pp_slot[:c], pp_w[:c]) if plan_push else None)

    def _run_step(self, worker_of, order, keys, off) -> Pending:
        """Step t+1's before-forward (evict, pull) and after-backward (grad push, local
        update) passes on the snapshots (NOTE [step protocol]); its plan pushes come later."""
        cfg = self.config
        counts = np.zeros((cfg.num_workers, len(CAUSES)), np.int64)
        before = self._snap.before_forward(keys, off, counts, threads=cfg.threads)
        _check_before_forward(before[-1], off, self._next_step, self.capacity_rows)
        after = self._snap.after_backward(keys, off, cfg.full_sync, threads=cfg.threads)
        counts[:, K.GRAD_PUSH] = after[3]
        step = self._next_step
        self._next_step += 1
        return Pending(step, worker_of, order, counts, keys, off, before[:5], after)

    def _finalize(self, p: Pending, pp) -> StepPlan:
        W = self.config.num_workers
        counts = p.counts
        if pp is not None:
            counts[:, K.PLAN_PUSH] = np.bincount(pp[1], minlength=W)
        self._totals += counts
        Bw = self.config.batch_size_per_worker
        assignment = [p.order[w * Bw : (w + 1) * Bw].copy() for w in range(W)]
        plans = self._build_plans(p, pp) if self.build_plans else []
        return StepPlan(p.step, assignment, plans, counts)

    def _build_plans(self, p: Pending, pp) -> list:
        s = self._snap
        gather = self._par.gather_plan_keys if self._par is not None else None
        return build_plans(p.off, p.before, p.after, pp, s.slot_tab, s.slot_ids, gather=gather)
