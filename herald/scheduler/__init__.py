"""Allocation (LAIA), cache snapshots, communication plan and accounting. Pure computation.

Public API::

    from herald.scheduler import Scheduler, SchedulerConfig, StepPlan
    sched = Scheduler(SchedulerConfig(num_workers=8, batch_size_per_worker=128), num_tables=T,
                      distinct_keys=n)
    step = sched.submit(global_batch)   # StepPlan of the previous step, or None
    last = sched.finish(); flush = sched.flush()

See docs/scheduler.md.
"""

import importlib

# Names are imported on first use (PEP 562): building the herald parser, or a process that
# needs one module, does not load every kernel of the package.
_EXPORTS = {
    "SchedulerConfig": "config",
    "CAUSES": "plan",
    "CachePlan": "plan",
    "KeySet": "plan",
    "Scheduler": "scheduler",
    "StepPlan": "scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"herald.scheduler.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'herald.scheduler' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
