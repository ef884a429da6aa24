"""Adaptive LAIA (Herald §4.3): the table profiler (degree of infrequency, DoI).

An in-cache key is *infrequent* when its popularity so far is below the number of
samples each worker has trained so far (Herald §3.2, applied online). A table's DoI
is the fraction of its in-cache keys (cached by any worker) that are infrequent. The
allocation scores only the ``k`` tables with the highest DoI; ``k`` comes from the
scheduling budget and the scheduling time measured online
(:class:`herald.scheduler.budget.BudgetController`).
"""

from __future__ import annotations

import numpy as np

from herald.errors import DataError
from herald.scheduler import kernels as K


class TableProfiler:
    """Online DoI per table, refreshed every ``interval_steps`` steps.

    Args:
        num_tables: T. interval_steps: refresh period in steps.
    """

    def __init__(self, num_tables: int, interval_steps: int) -> None:
        self.num_tables = num_tables
        self.interval_steps = interval_steps
        self.doi = np.ones(num_tables, np.float64)
        self._infrequent = np.zeros(num_tables, np.int64)
        self._total = np.zeros(num_tables, np.int64)
        self._since = interval_steps  # refresh on the first call

    def maybe_refresh(self, snaps, samples_per_worker_seen: int) -> None:
        """Recompute the DoI from ``snaps`` (a :class:`Snapshots`) if the period elapsed."""
        self._since += 1
        if self._since < self.interval_steps:
            return
        self._since = 0
        K.doi_jit(
            snaps.freq,
            snaps.slot_tab,
            snaps.cached,
            snaps.num_keys,
            samples_per_worker_seen,
            self.num_tables,
            self._infrequent,
            self._total,
        )
        with np.errstate(invalid="ignore", divide="ignore"):
            doi = self._infrequent / self._total
        self.doi = np.where(self._total > 0, doi, 1.0)

    def arrays(self) -> dict[str, np.ndarray]:
        """Its state (the DoI, the counters, the steps since the last refresh), copies."""
        since = np.array([self._since], np.int64)
        return {
            "doi": self.doi.copy(),
            "infrequent": self._infrequent.copy(),
            "total": self._total.copy(),
            "since": since,
        }

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Take back :meth:`arrays` of a profiler of as many tables.

        Raises:
            DataError: other parts or shapes.
        """
        mine = self.arrays()
        if set(arrays) != set(mine) or any(np.shape(arrays[k]) != v.shape for k, v in mine.items()):
            raise DataError("scheduler warm state: the table profiler's state does not fit this scheduler's tables")
        self.doi = arrays["doi"].astype(np.float64).copy()
        self._infrequent = arrays["infrequent"].astype(np.int64).copy()
        self._total = arrays["total"].astype(np.int64).copy()
        self._since = int(arrays["since"][0])

    def top_tables(self, k: int) -> np.ndarray:
        """bool [T]: the ``k`` tables with the highest DoI (ties: lower table index)."""
        order = np.argsort(-self.doi, kind="stable")[:k]
        mask = np.zeros(self.num_tables, np.bool_)
        mask[order] = True
        return mask
