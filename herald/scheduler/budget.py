"""Adaptive LAIA's budget controller (Herald §4.3): how many tables ``k`` allocation scores.

Herald §4.3 ("Scheduling budget measurement"): the scheduler must stay off the critical
path, so its time per global batch must fit the *necessary iteration time* (profiled in
advance) minus the plan-generation time; only the allocation adapts, by scoring the k
tables with the highest degree of infrequency. Here the budget is either a number of
milliseconds or ``auto``: a fraction of the *measured* period between successive
``submit`` calls. The dispatcher's scheduling thread is back-pressured by the workers'
credits (it stays ``max_inflight_steps`` ahead), so once the pipeline is full that
period is the training step time.

Why a fraction (``AUTO_BUDGET_FRACTION`` = 0.5, herald/scheduler/config.py): the period
is an upper bound of what Herald calls the necessary iteration time (it includes the
embedding communication, which Herald excludes), and in the period the same thread also
reads the next batch; half of it leaves room for both and for the step-to-step jitter
of the median, and keeps the scheduling thread idle at least half of the time, so it
does not compete with the training processes for cores on a shared host.

Rule, per step, on medians over the last ``window`` steps (the first ``warmup_steps`` = 10
steps are not acted on, as Herald §6.1 drops 10 warm-up iterations: they include loading
the kernels and the dispatcher's pipeline filling up, ~``max_inflight_steps`` + 5 steps
read ahead before the workers' credits hold it back, whose periods are short):
``time(k) = fixed + k * per_table`` with ``per_table`` = allocation time / k and
``fixed`` = the rest of ``submit``. If even ``time(1)`` exceeds the budget, lowering k
cannot meet it: k is kept, ``budget_unreachable`` counts the step and a notice is
printed once. Otherwise ``k = min(T, floor((budget - fixed) / per_table))``, at least 1.
"""

from __future__ import annotations

import statistics
import sys
from collections import deque

from herald.config import require

#: entries kept in ``series`` (k at every change), so the stats stay small on long jobs
MAX_SERIES = 256


class BudgetController:
    """Choose k (tables scored by adaptive LAIA) so that scheduling fits the budget.

    Args:
        num_tables: T, the most tables allocation can score.
        budget_ms: a budget in milliseconds (> 0), or ``"auto"`` (``fraction`` of the
            median measured period between ``submit`` calls).
        fraction: the share of the period given to scheduling with ``"auto"``, in (0, 1].
        window: steps in the medians. warmup_steps: first steps not acted on.

    One controller may serve successive schedulers of one job (the dispatcher makes a
    fresh scheduler after each checkpoint barrier): k, the medians and the statistics
    carry over.

    Raises:
        ConfigError: a value out of range.
    """

    def __init__(
        self, num_tables: int, budget_ms, *, fraction: float = 0.5, window: int = 16, warmup_steps: int = 10
    ) -> None:
        require(num_tables >= 1, f"num_tables must be >= 1, got {num_tables}")
        require(
            budget_ms == "auto"
            or (
                isinstance(budget_ms, (int, float)) and not isinstance(budget_ms, bool) and 0 < budget_ms < float("inf")
            ),
            f"budget_ms must be 'auto' or a number of ms > 0, got {budget_ms!r}",
        )
        require(0 < fraction <= 1, f"fraction must be in (0, 1], got {fraction!r}")
        require(window >= 1 and warmup_steps >= 0, "window must be >= 1 and warmup_steps >= 0")
        self.num_tables = num_tables
        self.auto = budget_ms == "auto"
        self.fraction = float(fraction)
        self.fixed_budget_s = None if self.auto else float(budget_ms) / 1e3
        self.warmup_steps = warmup_steps
        self.k = num_tables
        self.steps = 0
        self.budget_unreachable = 0
        self.notice: str | None = None
        self._last_start: float | None = None
        self._periods: deque = deque(maxlen=window)
        self._fixed: deque = deque(maxlen=window)
        self._per_table: deque = deque(maxlen=window)
        self._k_steps = [0] * (num_tables + 1)  # steps scheduled with each k (bounded memory)
        self._k_first: int | None = None
        self._k_last: int | None = None
        self.series: list[list[int]] = []  # [step, k] at every change of k, from step 0

    # ------------------------------------------------------------------ measurements
    @property
    def budget_s(self) -> float | None:
        """The current budget in seconds (None: ``auto`` without enough periods yet)."""
        if not self.auto:
            return self.fixed_budget_s
        if len(self._periods) == 0:
            return None
        return self.fraction * statistics.median(self._periods)

    def observe(self, k: int, alloc_s: float, total_s: float, start_s: float) -> int:
        """Record one step scheduled with ``k`` tables; returns k for the next step.

        Args:
            k: tables the step's allocation scored. alloc_s: its allocation time, s.
            total_s: its whole ``submit`` time, s. start_s: when that ``submit`` started
                (``time.perf_counter()``, s); the period is the time since the previous
                start (only ``auto`` uses it).
        """
        period_s = None if self._last_start is None else start_s - self._last_start
        self._last_start = start_s
        self._record(k)
        self.steps += 1
        if self.steps <= self.warmup_steps:
            return self.k
        if period_s is not None and period_s > 0:
            self._periods.append(period_s)
        self._per_table.append(alloc_s / max(k, 1))
        self._fixed.append(max(0.0, total_s - alloc_s))
        budget = self.budget_s
        if budget is None:
            return self.k
        fixed = statistics.median(self._fixed)
        per_table = statistics.median(self._per_table)
        if fixed + per_table > budget:  # even k = 1 does not fit: lowering k cannot help
            self.budget_unreachable += 1
            if self.notice is None:
                self.notice = (
                    f"scheduling budget {1e3 * budget:.3f} ms is below what k = 1 table takes "
                    f"({1e3 * (fixed + per_table):.3f} ms: {1e3 * fixed:.3f} ms outside allocation); "
                    f"keeping k = {self.k} of {self.num_tables} tables (lowering it would cost "
                    "transmissions and still miss the budget); see stats()['budget_unreachable']"
                )
                print(f"herald scheduler: {self.notice}", file=sys.stderr, flush=True)
            return self.k
        fit = int((budget - fixed) // per_table) if per_table > 0 else self.num_tables
        self.k = min(max(fit, 1), self.num_tables)
        return self.k

    def _record(self, k: int) -> None:
        k = int(min(max(k, 1), self.num_tables))
        if self._k_last != k and len(self.series) < MAX_SERIES:
            self.series.append([self.steps, k])
        if self._k_first is None:
            self._k_first = k
        self._k_last = k
        self._k_steps[k] += 1

    def _k_summary(self) -> dict | None:
        if self._k_first is None:
            return None
        used = [k for k, n in enumerate(self._k_steps) if n]
        half, seen, median = self.steps / 2, 0, used[-1]
        for k in used:  # the (lower) median of the per-step k, from the counts
            seen += self._k_steps[k]
            if seen >= half:
                median = k
                break
        return {"first": self._k_first, "min": used[0], "median": median, "max": used[-1], "final": self._k_last}

    # ------------------------------------------------------------------ report
    def stats(self) -> dict:
        """JSON-able summary: ``mode`` (``auto`` / ``fixed``), ``budget_ms`` (current),
        ``fraction`` (auto), ``period_ms_median`` (auto), ``steps``, ``k`` (``first``,
        ``min``, ``median``, ``max``, ``final`` over the steps; None before any),
        ``series`` ([step, k] at every change, at most :data:`MAX_SERIES`),
        ``budget_unreachable`` (steps where even k = 1 would not fit) and ``notice``."""
        budget = self.budget_s
        return {
            "mode": "auto" if self.auto else "fixed",
            "budget_ms": None if budget is None else 1e3 * budget,
            "fraction": self.fraction if self.auto else None,
            "period_ms_median": 1e3 * statistics.median(self._periods) if self._periods else None,
            "num_tables": self.num_tables,
            "steps": self.steps,
            "k": self._k_summary(),
            "series": [list(p) for p in self.series],
            "budget_unreachable": self.budget_unreachable,
            "notice": self.notice,
        }
