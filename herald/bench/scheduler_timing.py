"""The child process of ``herald bench scheduler --compare-ref``: one timed run of
``Scheduler.submit`` over a case's data, printed as one JSON line.

:mod:`herald.bench.scheduler_compare` runs this file by its path (``python -P FILE``), with
``PYTHONPATH`` set to the tree measured: the herald it imports is that tree's (a git
revision's, or this checkout's), so it uses only names every revision has
(``herald.bench.scheduler.load_batches``, ``Scheduler``, ``SchedulerConfig``).

    python -P herald/bench/scheduler_timing.py DATA SCHEDULE WORKERS PER_WORKER BUILD_PLANS
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from herald.bench.scheduler import load_batches
from herald.loader.splits import count_distinct_keys
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.scheduler import Scheduler


def timing_worker(data: str, schedule: str, workers: int, per_worker: int, build_plans: bool) -> dict:
    """One run of ``Scheduler.submit`` over ``data`` after a warm-up run (every kernel compiled).

    Returns:
        ``{"submit_ms": [...], "cpu_ms": [...], "counts": sha256 hex}``: each step's
        ``Scheduler.submit_seconds`` and thread CPU time in ms, and a digest of every plan's counts.
    """
    batches, tables, _ = load_batches(data, workers * per_worker)
    distinct = count_distinct_keys(batches)
    cfg = SchedulerConfig(
        num_workers=workers, batch_size_per_worker=per_worker, schedule=schedule, cache_ratio=0.1, seed=0
    )
    warm = Scheduler(cfg, len(tables), distinct, build_plans=build_plans)  # compile every kernel
    for b in batches[:3]:
        warm.submit(b)
    warm.finish()
    sched = Scheduler(cfg, len(tables), distinct, build_plans=build_plans)
    digest = hashlib.sha256()
    cpu_ms = []
    for b in batches + [None]:
        t0 = time.thread_time()
        p = sched.submit(b) if b is not None else sched.finish()
        if b is not None:
            cpu_ms.append(1e3 * (time.thread_time() - t0))
        if p is not None:
            digest.update(np.ascontiguousarray(p.counts).tobytes())
    return {"submit_ms": [1e3 * s for s in sched.submit_seconds], "cpu_ms": cpu_ms, "counts": digest.hexdigest()}


if __name__ == "__main__":
    d, s, w, b, plans = sys.argv[1:6]
    print(json.dumps(timing_worker(d, s, int(w), int(b), bool(int(plans)))))
