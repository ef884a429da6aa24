"""The scheduler front class: allocation, cache snapshots, communication plan, accounting.

Pipeline (Herald §4.2, Fig. 9): ``submit(batch of step t+1)`` allocates it on the
snapshots left by step ``t``, derives step ``t``'s plan pushes from that allocation
(Herald Alg. 2), then runs step ``t+1``'s before-forward (evict, pull) and after-backward
(grad push, local update) parts on the snapshots, and returns the finished plan of
step ``t``. Worker caches executing the plans in NOTE [step protocol]
(:mod:`herald.scheduler.plan`) equal the snapshots by construction.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from herald.config import require
from herald.errors import ConfigError, DataError, HeraldError
from herald.scheduler import kernels as K
from herald.scheduler import keymap_kernels as KM
from herald.scheduler.bruteforce import bruteforce_alloc
from herald.scheduler.budget import BudgetController
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.parallel import ParallelPasses
from herald.scheduler.plan import CAUSES, KeySet
from herald.scheduler.plan_build import build_plans
from herald.scheduler.profiler import TableProfiler
from herald.scheduler.state import Snapshots

#: most tables whose arrays ``_prepare`` passes to the kernels as tuples (else it concatenates)
_MAX_TUPLE_TABLES = 64


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


@dataclasses.dataclass
class _Pending:
    step: int
    worker_of: np.ndarray
    order: np.ndarray
    counts: np.ndarray
    keys: np.ndarray
    off: np.ndarray
    before: tuple
    after: tuple


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
    ) -> None:
        require(isinstance(config, SchedulerConfig), "config must be a SchedulerConfig")
        require(1 <= num_tables <= 32767, f"num_tables must be in 1..32767, got {num_tables}")
        self.config = config
        self.num_tables = num_tables
        if config.cache_capacity_rows is not None:
            cap = config.cache_capacity_rows
        elif distinct_keys is not None:
            require(distinct_keys >= 1, f"distinct_keys must be >= 1, got {distinct_keys}")
            cap = max(1, math.ceil(config.cache_ratio * distinct_keys))
        else:
            raise ConfigError(
                "cannot size the worker caches: pass distinct_keys (e.g. from "
                "herald.scheduler.count_distinct_keys over a pre-pass) to use cache_ratio, "
                "or set cache_capacity_rows"
            )
        self.capacity_rows = int(cap)
        self.build_plans = build_plans
        W = config.num_workers
        # with distinct_keys known, reserve the key state once (no regrowth while scheduling)
        self._snap = Snapshots(
            W,
            self.capacity_rows,
            config.cache_policy,
            initial_slots=int(distinct_keys) + 1024 if distinct_keys else 1 << 10,
        )
        self._rng = np.array([config.seed], np.uint64)
        self._pending: _Pending | None = None
        self._next_step = 0
        self._finished = False
        self._used = False  # submit() was called (load_state_dict only on an unused scheduler)
        self._in_flight = False  # submitted and not yet finish() + flush(): state_dict() raises
        self._totals = np.zeros((W, len(CAUSES)), np.int64)
        self._all_tables = np.ones(num_tables, np.bool_)
        self._profiler = TableProfiler(num_tables, config.profile_interval_steps) if config.adaptive else None
        if budget is not None:
            require(
                config.scheduling_budget_ms is not None and budget.num_tables == num_tables,
                "a shared BudgetController needs scheduling_budget_ms set and the same num_tables",
            )
        elif config.scheduling_budget_ms is not None:
            budget = BudgetController(num_tables, config.scheduling_budget_ms, fraction=config.auto_budget_fraction)
        self._budget = budget
        self.num_scored_tables = (
            num_tables if config.adaptive_num_tables is None else min(config.adaptive_num_tables, num_tables)
        )
        if budget is not None:
            self.num_scored_tables = budget.k
        # Herald §4.4: the passes on config.threads threads (plans identical to one thread)
        self._par = ParallelPasses(config.threads) if config.threads > 1 else None
        #: seconds spent in each submit() (scheduling time per global batch).
        self.submit_seconds: list[float] = []
        self._samples_seen = 0
        contain = (
            config.costaware_contain_samples
            if config.costaware_contain_samples is not None
            else max(1, config.batch_size_per_worker // 4)
        )
        # gains: valid copy, in-use containable key, in-use hot key, sharing cost, containable
        # limit (samples), sort by affinity (see kernels.costaware_alloc_jit)
        self._ca_params = np.array([1.0, 1.0, 0.0, config.costaware_share_cost, contain, 1.0], np.float64)

    # ------------------------------------------------------------------ public
    @property
    def snapshots(self) -> Snapshots:
        """The cache snapshots (read-only use)."""
        return self._snap

    @property
    def table_doi(self):
        """float64 [T]: degree of infrequency per table (adaptive LAIA), or None when static."""
        return None if self._profiler is None else self._profiler.doi.copy()

    def scored_tables(self) -> np.ndarray:
        """bool [T]: tables the next allocation scores (all for static LAIA)."""
        return self._table_mask().copy()

    def totals(self) -> np.ndarray:
        """int64 [num_workers, len(CAUSES)]: counts accumulated over finished steps."""
        return self._totals.copy()

    def stats(self) -> dict:
        """JSON-able: ``threads``, ``lock_free_allocation``, ``num_tables``,
        ``num_scored_tables`` (k of the next step), ``submit_ms_median`` (None before any
        step) and ``adaptive``: the budget controller's :meth:`BudgetController.stats`
        (k over time, ``budget_unreachable``), or None without a budget."""
        sub = self.submit_seconds
        return {
            "threads": self.config.threads,
            "lock_free_allocation": self.config.lock_free_allocation,
            "num_tables": self.num_tables,
            "num_scored_tables": int(self.num_scored_tables),
            "submit_ms_median": 1e3 * float(np.median(sub)) if sub else None,
            "adaptive": self._budget.stats() if self._budget is not None else None,
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
        if batch.num_tables != self.num_tables:
            raise DataError(f"batch has {batch.num_tables} tables, scheduler was built for {self.num_tables}")
        self._used = self._in_flight = True
        self._snap.renew_tokens()
        par = self._par
        if par is not None:
            par.enter()
        samp_off, samp_slot, samp_tab = self._prepare(batch)
        table_on = self._table_mask()
        ta = time.perf_counter()
        worker_of = self._allocate(samp_off, samp_slot, samp_tab, table_on)
        alloc_s = time.perf_counter() - ta
        W, Bw = cfg.num_workers, cfg.batch_size_per_worker
        order = np.empty(worker_of.shape[0], np.int64)
        wstart = np.empty(W + 1, np.int64)  # = Bw * arange(W + 1): every worker gets Bw samples
        K.group_by_worker_jit(worker_of, order, wstart)
        nnz = samp_slot.shape[0]
        keys = np.empty(nnz, np.int32)
        off = np.empty(W + 1, np.int64)
        pp_slot = np.empty(nnz, np.int32)
        pp_w = np.empty(nnz, np.int32)
        s = self._snap
        prev = self._pending
        plan_push = prev is not None and not cfg.full_sync
        # one pass: K_w in canonical order and step t's plan pushes (Herald Alg. 2, same order)
        if par is not None:
            c = par.collect_keys(
                samp_off,
                samp_slot,
                order,
                wstart,
                s,
                self._profiler is not None,
                cfg.allocation == "costaware",
                plan_push,
                keys,
                off,
                pp_slot,
                pp_w,
            )
        else:
            c = K.collect_keys_jit(
                samp_off,
                samp_slot,
                order,
                wstart,
                s.mark,
                s.token,
                s.use_mask,
                s.freq,
                self._profiler is not None,
                cfg.allocation == "costaware",
                s.owner,
                plan_push,
                keys,
                off,
                pp_slot,
                pp_w,
            )
        keys = keys[: off[-1]]
        pp = (pp_slot[:c], pp_w[:c]) if plan_push else None
        self._pending = self._run_step(worker_of, order, keys, off)
        self._samples_seen += Bw
        done = self._finalize(prev, pp) if prev is not None else None
        total_s = time.perf_counter() - t0
        self.submit_seconds.append(total_s)
        if self._profiler is not None:
            self._profiler.maybe_refresh(s, self._samples_seen)
            if self._budget is not None:
                self.num_scored_tables = self._budget.observe(self.num_scored_tables, alloc_s, total_s, t0)
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
        """The scheduler's state at a checkpoint barrier (JSON-able).

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
        return {
            "format": "scheduler",
            "config": dataclasses.asdict(self.config),
            "num_tables": self.num_tables,
            "capacity_rows": self.capacity_rows,
            "next_step": self._next_step,
            "totals": self._totals.tolist(),
        }

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
        if not isinstance(state, dict) or state.get("format") != "scheduler":
            raise DataError("not a Scheduler state; pass Scheduler.state_dict()")
        config = state.get("config")
        mine = dataclasses.asdict(self.config)
        if not isinstance(config, dict) or set(config) != set(mine):
            raise DataError(
                f"malformed scheduler state: 'config' must hold the SchedulerConfig fields "
                f"{sorted(mine)}, got {config!r}"
            )
        theirs = {**config, "num_tables": state.get("num_tables"), "capacity_rows": state.get("capacity_rows")}
        mine.update(num_tables=self.num_tables, capacity_rows=self.capacity_rows)
        differ = sorted(k for k in mine if theirs[k] != mine[k])
        if differ:
            raise ConfigError(
                "state saved by a scheduler with other settings: "
                + ", ".join(f"{k}={theirs[k]!r} (this one: {mine[k]!r})" for k in differ)
                + "; build the scheduler with the same settings"
            )
        step = state.get("next_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise DataError(f"malformed scheduler state: 'next_step' must be an int >= 0, got {step!r}")
        try:
            totals = np.array(state.get("totals"))
        except (TypeError, ValueError, OverflowError):
            totals = None
        if totals is None or totals.dtype.kind not in "iu" or totals.shape != self._totals.shape or (totals < 0).any():
            raise DataError(
                f"malformed scheduler state: 'totals' must be {self._totals.shape[0]} x "
                f"{self._totals.shape[1]} counts >= 0"
            )
        self._next_step, self._totals = step, totals.astype(np.int64)

    # ------------------------------------------------------------------ parts
    def _prepare(self, batch):
        """Key lookup and the sample-major CSR (int64 [B+1], int32 [nnz], int16 [nnz]).

        The kernels read the batch's per-table arrays directly (a tuple of arrays) when
        they are all C-contiguous uint64 ids and int64 offsets and there are at most
        ``_MAX_TUPLE_TABLES`` tables (numba compiles one kernel per tuple length, with a
        branch per table at each runtime index); otherwise the ids are concatenated and
        the offsets stacked first (:meth:`_prepare_concat`). Both give the same CSR.
        """
        values = tuple(batch.values)
        offsets = tuple(batch.offsets)
        B = len(batch)
        nnz = 0
        direct = len(values) <= _MAX_TUPLE_TABLES
        for v, o in zip(values, offsets):
            nnz += v.shape[0]
            if v.dtype != np.uint64 or o.dtype != np.int64 or not v.flags.c_contiguous or not o.flags.c_contiguous:
                direct = False
        if not direct:
            return self._prepare_concat(batch)
        if self._par is not None:
            return self._par.lookup_and_gather(self._snap, values, offsets, B, nnz)
        slots = self._snap.lookup_tables(values, nnz)
        samp_off = np.empty(B + 1, np.int64)
        samp_slot = np.empty(nnz, np.int32)
        samp_tab = np.empty(nnz, np.int16)
        KM.gather_samples_tables_jit(offsets, slots, samp_off, samp_slot, samp_tab)
        return samp_off, samp_slot, samp_tab

    def _prepare_concat(self, batch):
        """:meth:`_prepare` for batches whose arrays the kernels cannot take as a tuple."""
        T = self.num_tables
        nnz = np.array([v.shape[0] for v in batch.values], np.int64)
        ids = np.concatenate(batch.values) if T > 1 else batch.values[0]
        if ids.dtype != np.uint64:
            raise DataError(f"key ids must be uint64, got {ids.dtype}")
        tabs = np.repeat(np.arange(T, dtype=np.int16), nnz)
        slots = self._snap.lookup(tabs, ids)
        offsets = np.stack(batch.offsets)
        base = np.zeros(T, np.int64)
        np.cumsum(nnz[:-1], out=base[1:])
        B = len(batch)
        samp_off = np.empty(B + 1, np.int64)
        samp_slot = np.empty(slots.shape[0], np.int32)
        samp_tab = np.empty(slots.shape[0], np.int16)
        KM.gather_samples_jit(offsets, base, slots, samp_off, samp_slot, samp_tab)
        return samp_off, samp_slot, samp_tab

    def _table_mask(self) -> np.ndarray:
        if self._profiler is None or self.num_scored_tables >= self.num_tables:
            return self._all_tables
        return self._profiler.top_tables(self.num_scored_tables)

    def _allocate(self, samp_off, samp_slot, samp_tab, table_on) -> np.ndarray:
        cfg = self.config
        s = self._snap
        B = samp_off.shape[0] - 1
        out = np.empty(B, np.int32)
        kind = cfg.allocation
        if kind == "random":
            K.random_alloc_jit(B, cfg.batch_size_per_worker, self._rng, out)
        elif kind == "laia" and self._par is not None:
            return self._par.laia(
                samp_off,
                samp_slot,
                samp_tab,
                table_on,
                s,
                cfg.num_workers,
                cfg.batch_size_per_worker,
                self._rng,
                cfg.lock_free_allocation,
            )
        elif kind == "laia":
            K.laia_alloc_jit(
                samp_off,
                samp_slot,
                samp_tab,
                table_on,
                s.valid,
                s.mark,
                s.token,
                cfg.num_workers,
                cfg.batch_size_per_worker,
                self._rng,
                out,
            )
        elif kind == "costaware":
            K.costaware_alloc_jit(
                samp_off,
                samp_slot,
                samp_tab,
                table_on,
                s.valid,
                s.owner,
                s.use_mask,
                s.bcount,
                s.mark,
                s.token,
                cfg.num_workers,
                cfg.batch_size_per_worker,
                self._ca_params,
                self._rng,
                out,
            )
        elif kind == "bruteforce":
            bruteforce_alloc(s, samp_off, samp_slot, cfg.num_workers, out)
        else:  # pragma: no cover - SchedulerConfig validates the name
            raise ConfigError(f"unknown allocation {kind!r}")
        return out

    def _run_step(self, worker_of, order, keys, off) -> _Pending:
        cfg = self.config
        W = cfg.num_workers
        counts = np.zeros((W, len(CAUSES)), np.int64)
        s = self._snap
        before = s.before_forward(keys, off, counts, threads=cfg.threads)
        err = before[-1]
        if err[0] == 1:
            w = int(err[1])
            raise ConfigError(
                f"worker {w} needs {int(off[w + 1] - off[w])} distinct keys in step "
                f"{self._next_step} but its cache holds {self.capacity_rows} rows: "
                "use a bigger cache (cache_capacity_rows / cache_ratio) or a smaller "
                "batch_size_per_worker"
            )
        if err[0] == 2:  # pragma: no cover - would be a scheduler bug
            raise HeraldError(
                f"protocol violation: worker {int(err[1])} must pull a key whose latest "
                "copy is not at the PS (NOTE [step protocol])"
            )
        n = keys.shape[0]
        gp_slot = np.empty(n, np.int32)
        gp_contrib = np.empty(n, np.uint16)
        ul_slot = np.empty(n, np.int32)
        gp_cnt = np.zeros(W, np.int64)
        ul_cnt = np.zeros(W, np.int64)
        if self._par is not None:
            self._par.update(keys, off, s, cfg.full_sync, gp_slot, gp_contrib, ul_slot, gp_cnt, ul_cnt)
        else:
            K.update_after_step_jit(
                keys, off, s.use_mask, s.valid, s.owner, cfg.full_sync, gp_slot, gp_contrib, ul_slot, gp_cnt, ul_cnt
            )
        counts[:, K.GRAD_PUSH] = gp_cnt
        step = self._next_step
        self._next_step += 1
        return _Pending(
            step, worker_of, order, counts, keys, off, before[:5], (gp_slot, gp_contrib, ul_slot, gp_cnt, ul_cnt)
        )

    def _finalize(self, p: _Pending, pp) -> StepPlan:
        W = self.config.num_workers
        counts = p.counts
        if pp is not None:
            counts[:, K.PLAN_PUSH] = np.bincount(pp[1], minlength=W)
        self._totals += counts
        Bw = self.config.batch_size_per_worker
        assignment = [p.order[w * Bw : (w + 1) * Bw].copy() for w in range(W)]
        plans = self._build_plans(p, pp) if self.build_plans else []
        return StepPlan(p.step, assignment, plans, counts)

    def _build_plans(self, p: _Pending, pp) -> list:
        s = self._snap
        gather = self._par.gather_plan_keys if self._par is not None else None
        return build_plans(p.off, p.before, p.after, pp, s.slot_tab, s.slot_ids, gather=gather)
