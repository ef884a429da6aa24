"""Allocation (LAIA), cache snapshots, communication plan and accounting. Pure computation.

Public API::

    from herald.scheduler import Scheduler, SchedulerConfig, StepPlan
    sched = Scheduler(SchedulerConfig(num_workers=8, batch_size_per_worker=128), num_tables=T,
                      distinct_keys=n)
    step = sched.submit(global_batch)   # StepPlan of the previous step, or None
    last = sched.finish(); flush = sched.flush()

See docs/scheduler.md.
"""

from herald.scheduler.config import SchedulerConfig
from herald.scheduler.plan import CAUSES, CachePlan, KeySet
from herald.scheduler.scheduler import Scheduler, StepPlan, count_distinct_keys, distinct_keys_per_table

__all__ = ["CAUSES", "CachePlan", "KeySet", "Scheduler", "SchedulerConfig", "StepPlan",
           "count_distinct_keys", "distinct_keys_per_table"]
