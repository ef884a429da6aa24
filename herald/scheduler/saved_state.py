"""The scheduler's resumable state (NOTE [scheduler state] in herald/scheduler/scheduler.py):
what :meth:`Scheduler.state_dict` writes and the checks :meth:`Scheduler.load_state_dict`
runs on it."""

from __future__ import annotations

import dataclasses

import numpy as np

from herald.errors import ConfigError, DataError
from herald.scheduler.config import SchedulerConfig


def scheduler_state(
    config: SchedulerConfig, num_tables: int, capacity_rows: int, next_step: int, totals: np.ndarray
) -> dict:
    """``{"format": "scheduler", "config", "num_tables", "capacity_rows", "next_step",
    "totals"}`` (JSON-able; ``totals`` int64 [W, len(CAUSES)] as nested lists)."""
    return {
        "format": "scheduler",
        "config": dataclasses.asdict(config),
        "num_tables": num_tables,
        "capacity_rows": capacity_rows,
        "next_step": next_step,
        "totals": totals.tolist(),
    }


def check_scheduler_state(
    state, config: SchedulerConfig, num_tables: int, capacity_rows: int, totals_shape: tuple[int, int]
) -> tuple[int, np.ndarray]:
    """``(next_step, totals int64 [totals_shape])`` of a :func:`scheduler_state` saved by a
    scheduler with these settings.

    Raises:
        DataError: malformed state. ConfigError: saved with another configuration, table
            count or capacity (build the scheduler with the same settings).
    """
    if not isinstance(state, dict) or state.get("format") != "scheduler":
        raise DataError("not a Scheduler state; pass Scheduler.state_dict()")
    saved = state.get("config")
    mine = dataclasses.asdict(config)
    if not isinstance(saved, dict) or set(saved) != set(mine):
        raise DataError(
            f"malformed scheduler state: 'config' must hold the SchedulerConfig fields {sorted(mine)}, got {saved!r}"
        )
    theirs = {**saved, "num_tables": state.get("num_tables"), "capacity_rows": state.get("capacity_rows")}
    mine.update(num_tables=num_tables, capacity_rows=capacity_rows)
    differ = sorted(k for k in mine if theirs[k] != mine[k])
    if differ:
        raise ConfigError(
            "state saved by a scheduler with other settings: "
            + ", ".join(f"{k}={theirs[k]!r} (this one: {mine[k]!r})" for k in differ)
            + "; build the scheduler with the same settings"
        )
    step = state.get("next_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise DataError(f"malformed scheduler state: 'next_step' must be an int >= 0, got {step!r}")
    try:
        totals = np.array(state.get("totals"))
    except (TypeError, ValueError, OverflowError):
        totals = None
    if totals is None or totals.dtype.kind not in "iu" or totals.shape != totals_shape or (totals < 0).any():
        raise DataError(
            f"malformed scheduler state: 'totals' must be {totals_shape[0]} x {totals_shape[1]} counts >= 0"
        )
    return step, totals.astype(np.int64)
