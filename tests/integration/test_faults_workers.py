"""A worker that stops answering during `herald train` is the one the error names first
(NOTE [silent workers] in herald/job/recovery/silence.py), not the healthy worker that timed out
waiting on it. Real `herald train` jobs: 2 workers, MovieLens ratings."""

from __future__ import annotations

import pytest
from proc_tree import stopped, train_until_mid_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.slow  # ~30 s (2 shared cores)
def test_a_stopped_worker_is_named_in_the_headline(tmp_path, data_dir):
    job, worker = train_until_mid_job(tmp_path, data_dir, "serve worker", "--rank 0")
    with stopped(worker):
        _, err = job.communicate(timeout=120)
    assert job.returncode != 0, err[-3000:]
    headline = next(line for line in err.splitlines() if line.startswith("herald: error: "))
    assert headline.startswith(f"herald: error: worker-0 (pid {worker}, stopped"), err[-3000:]
    assert "went silent" in headline and str(tmp_path / "worker-0.log") in headline
    assert "worker-1" not in headline  # the worker that timed out waiting comes after, as "(then: ...)"
