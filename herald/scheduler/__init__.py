"""Allocation (LAIA), cache snapshots, communication plan and accounting. Pure computation.

Public API::

    from herald.scheduler import Scheduler, SchedulerConfig, StepPlan
    sched = Scheduler(SchedulerConfig(num_workers=8, batch_size_per_worker=128), num_tables=T,
                      distinct_keys=n)
    step = sched.submit(global_batch)   # StepPlan of the previous step, or None
    last = sched.finish(); flush = sched.flush()

Its output types (``KeySet``, ``CachePlan``, ``CAUSES``) are contracts shared with the
worker: :mod:`herald.contracts.plan`. See docs/scheduler.md.
"""

from herald.lazy import lazy_package

# Names are imported on first use (PEP 562, herald/lazy.py): submodule -> the names it defines.
lazy_package(
    globals(),
    {
        "config": ("SchedulerConfig",),
        "scheduler": ("Scheduler", "StepPlan"),
    },
)
