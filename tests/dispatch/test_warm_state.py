"""A checkpoint's warm state on the dispatcher's side (NOTE [warm resume] in
herald/dispatch/warm.py): written into the checkpoint folder, loaded only where it applies."""

from __future__ import annotations

import numpy as np
import pytest

from herald.dispatch.warm import SCHEDULER_FILE, WarmState, load_scheduler, save_scheduler
from herald.errors import DataError
from herald.loader.batch import SampleBatch
from herald.scheduler import Scheduler, SchedulerConfig

W, BW, T = 2, 8, 3
BSP = {"name": "bsp"}


def random_batches(seed: int, n: int, size: int, tables: int, vocab: int) -> list[SampleBatch]:
    """``n`` single-hot global batches of ``size`` samples, ids below ``vocab``."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, (size, tables)).astype(np.uint64) for _ in range(n)]
    return [SampleBatch.from_single_hot(np.zeros(size, np.float32), np.zeros((size, 0), np.float32), i) for i in ids]


def _cfg(rows: int = 40) -> SchedulerConfig:
    return SchedulerConfig(num_workers=W, batch_size_per_worker=BW, cache_capacity_rows=rows, seed=1)


@pytest.fixture
def entry(tmp_path):
    s = Scheduler(_cfg(), T)
    for b in random_batches(7, 3, W * BW, T, vocab=50):
        s.submit(b)
    entry = save_scheduler(tmp_path, WarmState(*s.warm_state(), BSP))
    assert entry["file"] == SCHEDULER_FILE and (tmp_path / SCHEDULER_FILE).stat().st_mode & 0o777 == 0o600
    return entry


def test_the_warm_state_loads_where_it_applies(tmp_path, entry):
    fresh = Scheduler(_cfg(), T)
    assert load_scheduler(tmp_path, entry, fresh, BSP, allowed=True).loaded
    assert fresh.submit(random_batches(8, 1, W * BW, T, vocab=50)[0]).step == 2  # the saved pending step


def test_elsewhere_the_job_resumes_cold_and_says_why(tmp_path, entry):
    cases = [
        (Scheduler(_cfg(), T), BSP, False),  # a mode without warm resume (hybrid, gba)
        (Scheduler(_cfg(), T), {"name": "bounded", "staleness": 1}, True),  # other consistency settings
        (Scheduler(_cfg(rows=41), T), BSP, True),  # another cache size
    ]
    for sched, mode, allowed in cases:
        load = load_scheduler(tmp_path, entry, sched, mode, allowed=allowed)
        assert not load.loaded and load.cold
        assert sched.submit(random_batches(8, 1, W * BW, T, vocab=50)[0]) is None  # still a fresh scheduler
    assert "cache_capacity_rows=40" in load.cold


def test_a_malformed_entry_or_a_torn_file_is_named(tmp_path, entry):
    with pytest.raises(DataError, match="'warm' must name"):
        load_scheduler(tmp_path, {**entry, "file": "../x.npz"}, Scheduler(_cfg(), T), BSP, allowed=True)
    (tmp_path / SCHEDULER_FILE).write_bytes(b"torn")
    with pytest.raises(DataError, match=f"{SCHEDULER_FILE} is unreadable"):
        load_scheduler(tmp_path, entry, Scheduler(_cfg(), T), BSP, allowed=True)
