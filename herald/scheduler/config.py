"""Scheduler settings: one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses

from herald.config import require
from herald.contracts.vocab import CACHE_POLICIES, MAX_BRUTEFORCE_WORKERS, MAX_WORKERS, SCHEDULES

#: schedule name (one of :data:`herald.contracts.vocab.SCHEDULES`, which says what each is) ->
#: (allocation policy, full-set sync?).
POLICIES = {
    "vanilla": ("random", True),
    "laia": ("laia", True),
    "plan": ("random", False),
    "herald": ("laia", False),
    "costaware": ("costaware", False),
    "optimal": ("bruteforce", False),
}
if set(POLICIES) != set(SCHEDULES):  # a schedule added to the vocabulary needs its policy here
    raise ImportError(
        f"herald.scheduler.config.POLICIES {sorted(POLICIES)} must cover herald.contracts.vocab.SCHEDULES"
    )
MAX_THREADS = 256
#: ``scheduling_budget_ms="auto"``: the budget is this fraction of the measured step period
#: (docs/scheduler.md, "Adaptive budget"; :class:`herald.scheduler.profiler.BudgetController`).
AUTO_BUDGET_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Settings of :class:`herald.scheduler.Scheduler` (Herald §4; docs/scheduler.md).

    Args:
        num_workers: workers W, 1..64 (snapshots keep one bit per worker per key).
        batch_size_per_worker: samples per micro-batch; a global batch has exactly
            ``num_workers * batch_size_per_worker`` samples.
        schedule: one of :data:`SCHEDULES` (``vanilla``, ``laia``, ``plan``, ``herald``,
            ``costaware``; ``optimal`` needs batch_size_per_worker 1 and <= 8 workers).
        cache_policy: ``"lru"`` or ``"lfu"`` (HET §4.3), the same in workers and snapshots.
        cache_capacity_rows: rows per worker cache; overrides ``cache_ratio``.
        cache_ratio: capacity as a fraction of the distinct keys (``distinct_keys`` given
            to the scheduler), in (0, 1]. Default 0.1 (Herald §6.1).
        seed: seed of the tie-breaking / partition RNG (splitmix64).
        scheduling_budget_ms: adaptive LAIA (Herald §4.3) when set: allocation scores
            only the k tables with the highest degree of infrequency, k chosen online so
            that the measured scheduling time per global batch fits this budget (ms), or
            ``"auto"``: the budget is ``auto_budget_fraction`` of the measured period
            between successive ``submit`` calls (the training step time where the caller
            is back-pressured by training, as the dispatcher is). k is never lowered when
            even k = 1 would not fit (the scheduler counts it instead: ``stats()``).
            ``None`` = static (all tables).
        adaptive_num_tables: force k (tests, experiments); needs ``scheduling_budget_ms``
            unset. ``None`` = static or budget-driven.
        profile_interval_steps: steps between table-profiler (DoI) refreshes.
        costaware_contain_samples: ``costaware`` only: a key used by at most this many
            samples of a global batch is *containable* (one micro-batch can hold all its
            uses), so co-locating its samples is rewarded. ``None`` = batch_size_per_worker // 4
            (tuned on the five datasets; see docs/scheduler.md).
        costaware_share_cost: ``costaware`` only: cost, in transmissions, of adding a
            worker to a containable key that another worker already uses this step.
        threads: threads of the per-table, per-sample and per-worker passes (Herald §4.4,
            "Multi-threading"; :mod:`herald.scheduler.parallel`): key lookup, scoring,
            key collection, cache snapshots, update and plan keys. The plans equal those
            of ``threads=1``. 1 (default) runs no thread pool: on the 2-core machine it
            was measured on, 2 threads were not faster (docs/scheduler.md).
        lock_free_allocation: Herald §4.4's lock-free multi-threaded allocation (LAIA
            only): the samples and each worker's capacity are split evenly into
            ``threads`` parts placed independently. Deterministic for a given ``threads``
            but not equal to the serial allocation (transmissions measured against it by
            ``herald bench scheduler --threads``).
        auto_budget_fraction: with ``scheduling_budget_ms="auto"``, the fraction of the
            measured step period given to scheduling, in (0, 1].

    Raises:
        ConfigError: a value is out of range or settings conflict.
    """

    num_workers: int = 8
    batch_size_per_worker: int = 128
    schedule: str = "herald"
    cache_policy: str = "lru"
    cache_capacity_rows: int | None = None
    cache_ratio: float = 0.1
    seed: int = 0
    scheduling_budget_ms: float | str | None = None
    adaptive_num_tables: int | None = None
    profile_interval_steps: int = 16
    costaware_contain_samples: int | None = None
    costaware_share_cost: float = 0.0
    threads: int = 1
    lock_free_allocation: bool = False
    auto_budget_fraction: float = AUTO_BUDGET_FRACTION

    def __post_init__(self) -> None:
        require(
            isinstance(self.num_workers, int) and 1 <= self.num_workers <= MAX_WORKERS,
            f"num_workers must be an int in 1..{MAX_WORKERS}, got {self.num_workers!r}",
        )
        require(
            isinstance(self.batch_size_per_worker, int) and self.batch_size_per_worker >= 1,
            f"batch_size_per_worker must be an int >= 1, got {self.batch_size_per_worker!r}",
        )
        require(self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}; choose one of {sorted(SCHEDULES)}")
        require(
            self.schedule != "optimal"
            or (self.batch_size_per_worker == 1 and self.num_workers <= MAX_BRUTEFORCE_WORKERS),
            f"schedule 'optimal' (brute force) needs batch_size_per_worker=1 and num_workers <= "
            f"{MAX_BRUTEFORCE_WORKERS}",
        )
        require(
            self.cache_policy in CACHE_POLICIES,
            f"unknown cache_policy {self.cache_policy!r}; choose one of {list(CACHE_POLICIES)}",
        )
        require(
            self.cache_capacity_rows is None
            or (isinstance(self.cache_capacity_rows, int) and self.cache_capacity_rows >= 1),
            f"cache_capacity_rows must be None or an int >= 1, got {self.cache_capacity_rows!r}",
        )
        require(0.0 < float(self.cache_ratio) <= 1.0, f"cache_ratio must be in (0, 1], got {self.cache_ratio!r}")
        self._check_adaptive_and_threads()
        require(isinstance(self.seed, int) and self.seed >= 0, f"seed must be an int >= 0, got {self.seed!r}")

    def _check_adaptive_and_threads(self) -> None:
        """The checks of the budget, the threads and the costaware settings (in
        ``__post_init__``'s order: the first setting out of range raises)."""
        budget = self.scheduling_budget_ms
        require(
            budget is None
            or budget == "auto"
            or (isinstance(budget, (int, float)) and not isinstance(budget, bool) and 0 < float(budget) < float("inf")),
            f"scheduling_budget_ms must be None, 'auto' or a number of ms > 0, got {budget!r}",
        )
        require(
            isinstance(self.threads, int) and not isinstance(self.threads, bool) and 1 <= self.threads <= MAX_THREADS,
            f"threads must be an int in 1..{MAX_THREADS}, got {self.threads!r}",
        )
        require(
            isinstance(self.lock_free_allocation, bool),
            f"lock_free_allocation must be True or False, got {self.lock_free_allocation!r}",
        )
        require(
            not self.lock_free_allocation or self.allocation == "laia",
            f"lock_free_allocation applies to LAIA (schedule herald or laia), not schedule {self.schedule!r}",
        )
        require(
            isinstance(self.auto_budget_fraction, (int, float)) and 0 < self.auto_budget_fraction <= 1,
            f"auto_budget_fraction must be in (0, 1], got {self.auto_budget_fraction!r}",
        )
        require(
            self.adaptive_num_tables is None
            or (isinstance(self.adaptive_num_tables, int) and self.adaptive_num_tables >= 1),
            f"adaptive_num_tables must be None or an int >= 1, got {self.adaptive_num_tables!r}",
        )
        require(
            self.adaptive_num_tables is None or self.scheduling_budget_ms is None,
            "set either scheduling_budget_ms (k measured online) or adaptive_num_tables (fixed k), not both",
        )
        require(
            isinstance(self.profile_interval_steps, int) and self.profile_interval_steps >= 1,
            f"profile_interval_steps must be an int >= 1, got {self.profile_interval_steps!r}",
        )
        require(
            self.costaware_contain_samples is None
            or (isinstance(self.costaware_contain_samples, int) and self.costaware_contain_samples >= 1),
            f"costaware_contain_samples must be None or an int >= 1, got {self.costaware_contain_samples!r}",
        )
        require(
            float(self.costaware_share_cost) >= 0,
            f"costaware_share_cost must be >= 0, got {self.costaware_share_cost!r}",
        )

    @property
    def global_batch_size(self) -> int:
        """Samples per global batch: ``num_workers * batch_size_per_worker``."""
        return self.num_workers * self.batch_size_per_worker

    @property
    def allocation(self) -> str:
        """Allocation policy of the schedule: ``random``, ``laia``, ``costaware`` or ``bruteforce``."""
        return POLICIES[self.schedule][0]

    @property
    def full_sync(self) -> bool:
        """True for full-set synchronisation (``vanilla``, ``laia``)."""
        return POLICIES[self.schedule][1]

    @property
    def auto_budget(self) -> bool:
        """True when the scheduling budget follows the measured step period (``"auto"``)."""
        return self.scheduling_budget_ms == "auto"

    @property
    def adaptive(self) -> bool:
        """True when allocation scores a subset of tables (adaptive LAIA, Herald §4.3)."""
        return self.scheduling_budget_ms is not None or self.adaptive_num_tables is not None
