"""Simulation API: drive the scheduler over a batch stream and collect accounting.

Used by ``herald bench scheduler`` and tests. Herald's own counters map onto
``plan.CAUSES`` as: pulls = miss_pull + update_pull, pushes = grad_push +
plan_push + evict_push, total = pulls + pushes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from herald.contracts.plan import CAUSES
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.scheduler import Scheduler

PULLS = ("miss_pull", "update_pull")
PUSHES = ("grad_push", "plan_push", "evict_push")


@dataclasses.dataclass
class SimResult:
    """Per-step accounting of one simulated run.

    Attributes:
        config: the settings used. capacity_rows: rows per worker cache.
        counts: int64 [steps, num_workers, len(CAUSES)] by cause (step order).
        submit_ms: float64 [steps]: scheduling time of each global batch, milliseconds.
        num_keys: distinct keys tracked. scored_tables: tables used by allocation at the end.
        snapshot_bytes: bytes held by the cache snapshots at the end.
    """

    config: SchedulerConfig
    capacity_rows: int
    counts: np.ndarray
    submit_ms: np.ndarray
    num_keys: int
    scored_tables: int
    snapshot_bytes: int

    def total(self, causes: Sequence[str]) -> int:
        """Sum over steps and workers of the given causes."""
        idx = [CAUSES.index(c) for c in causes]
        return int(self.counts[:, :, idx].sum())

    @property
    def pulls(self) -> int:
        return self.total(PULLS)

    @property
    def pushes(self) -> int:
        return self.total(PUSHES)

    @property
    def transmissions(self) -> int:
        return self.pulls + self.pushes

    def by_cause(self) -> dict:
        """``{cause: total count}`` over the run."""
        return {c: int(self.counts[:, :, i].sum()) for i, c in enumerate(CAUSES)}


def to_bytes(counts: np.ndarray, dim: int, dtype="float32") -> np.ndarray:
    """Bytes moved: ``counts x dim x itemsize`` (int64, same shape as ``counts``).

    The ``hit`` column is not a transmission and is zeroed.
    """
    out = counts.astype(np.int64) * int(dim) * np.dtype(dtype).itemsize
    out[..., CAUSES.index("hit")] = 0
    return out


def simulate(
    batches: Iterable, config: SchedulerConfig, num_tables: int, distinct_keys: int | None = None
) -> SimResult:
    """Run the scheduler over ``batches`` (SampleBatch of exactly the global batch size).

    Raises what :meth:`Scheduler.submit` raises.
    """
    sched = Scheduler(config, num_tables, distinct_keys, build_plans=False)
    steps = []
    for b in batches:
        p = sched.submit(b)
        if p is not None:
            steps.append(p.counts)
    last = sched.finish()
    if last is not None:
        steps.append(last.counts)
    W = config.num_workers
    counts = np.stack(steps) if steps else np.zeros((0, W, len(CAUSES)), np.int64)
    return SimResult(
        config,
        sched.capacity_rows,
        counts,
        np.array(sched.submit_seconds) * 1e3,
        sched.snapshots.num_keys,
        sched.num_scored_tables,
        sched.snapshots.nbytes(),
    )


def quality_ratios(
    batches: Sequence,
    num_workers: int,
    num_tables: int,
    cache_capacity_rows: int,
    schedules=("herald", "costaware"),
    cache_policy: str = "lru",
    seed: int = 0,
) -> dict:
    """Herald App. C: transmissions of the brute-force scheduler / those of each schedule.

    ``batches`` must hold exactly ``num_workers`` samples each (one per worker).
    """

    def run(name):
        cfg = SchedulerConfig(
            num_workers=num_workers,
            batch_size_per_worker=1,
            schedule=name,
            cache_policy=cache_policy,
            cache_capacity_rows=cache_capacity_rows,
            seed=seed,
        )
        return simulate(batches, cfg, num_tables).transmissions

    best = run("optimal")
    return {name: best / max(run(name), 1) for name in schedules}
