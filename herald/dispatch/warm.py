"""A checkpoint's warm state: the scheduler and the worker caches of a job stopped off the
checkpoint grid.

NOTE [warm resume]: a barrier on the grid (every ``checkpoint_every_steps`` steps) empties
the workers' caches and starts a fresh scheduler, in the uninterrupted run as in a
resumed one, so that a checkpoint there holds the whole state (NOTE [checkpoint
barrier] in herald/dispatch/dispatcher.py). A job that stops between two such barriers
(``--steps``, SIGTERM, the end of the data) ends on a final barrier that the
uninterrupted run never has: there its caches stay warm and its scheduler goes on, and
a resume from empty caches allocates the next steps otherwise (LAIA scores the cached
copies), which changes the order of the dense and sparse gradient sums, and under
bounded staleness which copies are read stale. So a final barrier off the grid saves,
beside the PS rows and the dense state, what the uninterrupted run carries on:

- the scheduler's warm state (herald/scheduler/warm.py), taken before its last step is
  finished: cache snapshots, allocation RNG, profiler, the pending step;
  ``scheduler-warm.npz`` in the checkpoint folder, written by the dispatcher;
- every worker's cache: its slot map, rows and the protocol's per-copy state (HET's clocks),
  ``cache-rank<R>.npz``, written by each rank on ``save {path, caches: true}``
  (herald/worker/warm.py); the final barrier's flush wrote the only-latest rows back and
  kept the caches (``reset`` false), so the rows are the uninterrupted run's;
- the PS rows' clocks (NOTE [embedding clocks] in herald/ps/table.py), which bounded
  staleness compares with the copies' clocks.

A dispatcher resumed from it (:meth:`herald.dispatch.dispatcher.Dispatcher.load_state_dict`
with the checkpoint folder) loads the warm state into its first scheduler and tells the
workers, in their job (``JobSpec.resume_caches``), to load their caches. The scheduler's
first plan is then that of the checkpoint's last step with the plan pushes the
uninterrupted run had: it is not sent (trained already); the build thread takes from it
the keys that step touched (NOTE [early pulls]). The flush's write-backs leave the PS
holding the latest copy of keys whose only latest copy a worker also holds: the
scheduler still records that worker as the owner, as the uninterrupted run does, and
nothing reads the PS copy before that worker writes the same row again.

A warm state is used only where it applies: the mode's dispatcher entry allows it
(``DispatchMode.warm_resume``: bsp and bounded, whose workers' caches follow the plan)
and the resumed job has the same consistency settings and scheduler settings; otherwise
the job resumes from empty caches, as from a grid checkpoint, and :attr:`WarmLoad.cold`
says why. tests/integration/test_resume_off_grid.py checks the resumed model bit for bit.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import numpy as np

from herald.errors import ConfigError, DataError
from herald.files import read_arrays, write_arrays

#: the dispatcher's file in a checkpoint folder
SCHEDULER_FILE = "scheduler-warm.npz"


@dataclasses.dataclass
class WarmState:
    """A scheduler's warm state (``Scheduler.warm_state()``) and the consistency settings it
    was taken under (``JobSpec.mode.to_dict()``)."""

    meta: dict
    arrays: dict[str, np.ndarray]
    mode: dict


@dataclasses.dataclass(frozen=True)
class WarmLoad:
    """What a resumed dispatcher did with a checkpoint's warm state.

    Attributes:
        loaded: the first scheduler holds it and the workers load their caches.
        cold: why not, when the checkpoint has one (None: loaded, or the checkpoint has none).
    """

    loaded: bool = False
    cold: str | None = None


def save_scheduler(folder: str | pathlib.Path, warm: WarmState) -> dict[str, Any]:
    """Write the scheduler's arrays into the checkpoint ``folder``; returns the entry of the
    dispatcher state (``state["warm"]``: the file, the scheduler meta, the mode)."""
    write_arrays(pathlib.Path(folder) / SCHEDULER_FILE, warm.arrays)
    return {"file": SCHEDULER_FILE, "scheduler": warm.meta, "mode": warm.mode}


def load_scheduler(folder: str | pathlib.Path, entry: Any, scheduler: Any, mode: dict, allowed: bool) -> WarmLoad:
    """Load the warm state ``entry`` (``state["warm"]``) of the checkpoint ``folder`` into
    ``scheduler`` (fresh) when it applies: ``allowed`` by the mode's dispatcher entry and
    taken under the consistency settings ``mode``; else a :class:`WarmLoad` saying why not.

    Raises:
        DataError: a malformed entry or an unreadable file.
    """
    if not isinstance(entry, dict) or entry.get("file") != SCHEDULER_FILE:
        raise DataError(f"malformed dispatcher state: 'warm' must name {SCHEDULER_FILE}, got {entry!r}")
    if not allowed or entry.get("mode") != mode:
        return WarmLoad(cold=f"it was taken under {entry.get('mode')!r}, this job runs {mode!r}")
    try:
        scheduler.load_warm_state(entry.get("scheduler"), read_arrays(pathlib.Path(folder) / SCHEDULER_FILE))
    except ConfigError as exc:
        return WarmLoad(cold=str(exc))
    return WarmLoad(loaded=True)
