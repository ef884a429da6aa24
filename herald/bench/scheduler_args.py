"""The :class:`~herald.scheduler.config.SchedulerConfig` that ``herald bench scheduler``'s
options describe (:func:`herald.bench.options.add_scheduler_arguments`), for the table,
the adaptive and the thread runs alike."""

from __future__ import annotations

import argparse

from herald.scheduler.config import SchedulerConfig

#: SchedulerConfig field -> the option (argparse dest) that sets it
FIELDS = {
    "num_workers": "workers",
    "batch_size_per_worker": "batch_size",
    "cache_policy": "cache_policy",
    "cache_capacity_rows": "cache_rows",
    "cache_ratio": "cache_ratio",
    "seed": "seed",
}


def scheduler_config(args: argparse.Namespace, schedule: str, **settings) -> SchedulerConfig:
    """``SchedulerConfig`` of ``schedule`` with the options in ``args`` and ``settings`` on top.

    Raises:
        ConfigError: a value out of range (SchedulerConfig's checks).
    """
    return SchedulerConfig(schedule=schedule, **{f: getattr(args, o) for f, o in FIELDS.items()}, **settings)
