"""Which worker trains each sample of a global batch: the allocation policies and adaptive
LAIA's choice of the tables they score (Herald §4.1-§4.3, Alg. 1).

:class:`Allocator` is the part of :class:`herald.scheduler.Scheduler` that turns a batch's
sample-major CSR into ``worker_of`` (int32 [B]): ``random`` (vanilla, plan), ``laia``
(Herald Alg. 1, serial or on :class:`~herald.scheduler.parallel.ParallelPasses`),
``costaware`` and ``bruteforce`` (the step-optimal reference). With adaptive LAIA it holds
the table profiler (DoI, Herald §4.3) and the budget controller choosing ``k``, the number
of tables scored.
"""

from __future__ import annotations

import numpy as np

from herald.config import require
from herald.errors import ConfigError, DataError
from herald.scheduler import kernels as K
from herald.scheduler.bruteforce import bruteforce_alloc
from herald.scheduler.budget import BudgetController
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.parallel import ParallelPasses
from herald.scheduler.profiler import TableProfiler
from herald.scheduler.state import Snapshots


class Allocator:
    """The allocation of one scheduler (see the module docstring).

    Args:
        config: the scheduler's :class:`SchedulerConfig`. num_tables: T.
        par: the scheduler's :class:`ParallelPasses`, or None for one thread.
        budget: a shared :class:`BudgetController` (see :class:`herald.scheduler.Scheduler`),
            or None: one is made from the config when it sets a budget.

    Attributes:
        num_scored_tables: k, the tables the next allocation scores (T when static).

    Raises:
        ConfigError: a ``budget`` without ``scheduling_budget_ms`` or for another table count.
    """

    def __init__(
        self, config: SchedulerConfig, num_tables: int, par: ParallelPasses | None, budget: BudgetController | None
    ) -> None:
        self.config = config
        self.num_tables = num_tables
        self.par = par
        self.rng = np.array([config.seed], np.uint64)
        self.all_tables = np.ones(num_tables, np.bool_)
        self.profiler = TableProfiler(num_tables, config.profile_interval_steps) if config.adaptive else None
        if budget is not None:
            require(
                config.scheduling_budget_ms is not None and budget.num_tables == num_tables,
                "a shared BudgetController needs scheduling_budget_ms set and the same num_tables",
            )
        elif config.scheduling_budget_ms is not None:
            budget = BudgetController(num_tables, config.scheduling_budget_ms, fraction=config.auto_budget_fraction)
        self.budget = budget
        self.num_scored_tables = (
            num_tables if config.adaptive_num_tables is None else min(config.adaptive_num_tables, num_tables)
        )
        if budget is not None:
            self.num_scored_tables = budget.k
        contain = (
            config.costaware_contain_samples
            if config.costaware_contain_samples is not None
            else max(1, config.batch_size_per_worker // 4)
        )
        # gains: valid copy, in-use containable key, in-use hot key, sharing cost, containable
        # limit (samples), sort by affinity (see kernels.costaware_alloc_jit)
        self.ca_params = np.array([1.0, 1.0, 0.0, config.costaware_share_cost, contain, 1.0], np.float64)

    def warm_arrays(self) -> dict[str, np.ndarray]:
        """What it carries into the next step (herald/scheduler/warm.py): the RNG, k and
        the table profiler's state (adaptive LAIA); copies."""
        out = {"rng": self.rng.copy(), "k": np.array([self.num_scored_tables], np.int64)}
        if self.profiler is not None:
            out.update({f"profiler.{k}": v for k, v in self.profiler.arrays().items()})
        return out

    def load_warm_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Take back :meth:`warm_arrays` of an allocator with the same settings.

        Raises:
            DataError: other parts or shapes.
        """
        profiled = {k[len("profiler.") :]: v for k, v in arrays.items() if k.startswith("profiler.")}
        rng, k = arrays.get("rng"), arrays.get("k")
        if (
            set(arrays) - {"rng", "k"} != {f"profiler.{n}" for n in profiled}
            or not isinstance(rng, np.ndarray)
            or rng.shape != self.rng.shape
            or not isinstance(k, np.ndarray)
            or k.shape != (1,)
            or bool(profiled) != (self.profiler is not None)
        ):
            raise DataError("scheduler warm state: the allocation state does not fit this scheduler's settings")
        self.rng = rng.astype(np.uint64).copy()
        self.num_scored_tables = int(k[0])
        if self.profiler is not None:
            self.profiler.load_arrays(profiled)

    def table_mask(self) -> np.ndarray:
        """bool [T]: the tables the next allocation scores (all for static LAIA; not a copy)."""
        if self.profiler is None or self.num_scored_tables >= self.num_tables:
            return self.all_tables
        return self.profiler.top_tables(self.num_scored_tables)

    def allocate(self, samp_off, samp_slot, samp_tab, table_on, s: Snapshots) -> np.ndarray:
        """``worker_of`` int32 [B] of the batch ``(samp_off int64 [B+1], samp_slot int32 [nnz],
        samp_tab int16 [nnz])`` on the snapshots ``s``, scoring the tables ``table_on`` (bool [T],
        :meth:`table_mask`): every worker gets ``batch_size_per_worker`` samples."""
        cfg = self.config
        B = samp_off.shape[0] - 1
        out = np.empty(B, np.int32)
        kind = cfg.allocation
        W, Bw = cfg.num_workers, cfg.batch_size_per_worker
        if kind == "random":
            K.random_alloc_jit(B, Bw, self.rng, out)
        elif kind == "laia" and self.par is not None:
            return self.par.laia(samp_off, samp_slot, samp_tab, table_on, s, W, Bw, self.rng, cfg.lock_free_allocation)
        elif kind == "laia":
            K.laia_alloc_jit(samp_off, samp_slot, samp_tab, table_on, s.valid, s.mark, s.token, W, Bw, self.rng, out)
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
                W,
                Bw,
                self.ca_params,
                self.rng,
                out,
            )
        elif kind == "bruteforce":
            bruteforce_alloc(s, samp_off, samp_slot, W, out)
        else:  # pragma: no cover - SchedulerConfig validates the name
            raise ConfigError(f"unknown allocation {kind!r}")
        return out

    def after_step(
        self, snap: Snapshots, samples_per_worker_seen: int, alloc_s: float, total_s: float, t0: float
    ) -> None:
        """Adaptive LAIA after a ``submit`` that started at ``t0`` (``time.perf_counter()``) and
        took ``total_s`` seconds, ``alloc_s`` of them in :meth:`allocate`: refresh the DoI, and
        let the budget choose the next k."""
        if self.profiler is not None:
            self.profiler.maybe_refresh(snap, samples_per_worker_seen)
            if self.budget is not None:
                self.num_scored_tables = self.budget.observe(self.num_scored_tables, alloc_s, total_s, t0)
