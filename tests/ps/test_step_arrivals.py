"""NOTE [step arrivals] (herald/ps/arrivals.py): per step, which rank came last and by how
much; per rank, its own work between the barrier's replies."""

from __future__ import annotations

import numpy as np
import pytest

from herald.ps.arrivals import Arrivals
from herald.ps.server import ShardServer
from tests.ps.test_step_message import TABLES, _step_frames


def test_arrivals_name_the_last_rank_its_lag_and_margin_per_step():
    a = Arrivals(steps=8, ranks=4)
    # step 0: rank 2 last, 5 ms after rank 0, 3 ms after rank 1; released at 10.010
    a.record(0, [10.000, 10.002, 10.005], 10.010)
    # step 1: rank 0 last; own work counts from step 0's release end
    a.record(1, [10.030, 10.021, 10.020], 10.040)
    s = a.summary()
    assert s["steps"] == 2
    assert s["per_step"] == [[0, 2, 5.0, 3.0], [1, 0, 10.0, 9.0]]
    by = {r["rank"]: r for r in s["by_rank"]}
    assert [by[r]["last"] for r in range(3)] == [1, 0, 1]
    assert by[2]["lag_ms_mean"] == pytest.approx(2.5)
    # only step 1 has a predecessor released here: own work 20, 11, 10 ms
    assert [by[r]["own_ms_mean"] for r in range(3)] == pytest.approx([20.0, 11.0, 10.0])
    assert all(by[r]["own_ms_std"] == 0.0 for r in range(3))
    assert s["own_ms_std_within"] == 0.0
    assert s["own_ms_std_between"] == pytest.approx(float(np.std([20.0, 11.0, 10.0])), abs=1e-3)


def test_arrivals_keep_the_latest_steps_and_skip_own_work_after_a_gap():
    a = Arrivals(steps=3, ranks=2)
    for step in range(5):
        a.record(step, [float(step), step + 0.001 * (step + 1)], step + 0.5)
    a.forget()  # a restore: the next step's own work is not counted
    a.record(5, [9.0, 9.5], 9.6)
    a.record(7, [10.0, 10.25], 10.3)  # step 6 never released here
    s = a.summary()
    assert [p[0] for p in s["per_step"]] == [4, 5, 7]
    assert [p[1] for p in s["per_step"]] == [1, 1, 1]
    assert [p[2] for p in s["per_step"]] == [5.0, 500.0, 250.0]
    # own work only at step 4 (after step 3's release end, 3.5): not after the restore nor the gap
    assert [r["own_ms_mean"] for r in s["by_rank"]] == pytest.approx([500.0, 505.0])
    assert s["own_ms_std_within"] == 0.0


def test_an_empty_shard_has_no_arrivals():
    assert Arrivals().summary() == {"steps": 0}


def test_a_shard_keeps_each_rank_arrival_of_every_released_step():
    """Three ranks, three steps, the ranks sending in a rotating order: the shard names the
    rank that sent last at every step, the lags grow in send order, and every step after
    the first has each rank's own work (arrival after the previous release)."""
    srv = ShardServer(0, 1, tables=TABLES, seed=1)
    g = (np.array([0], np.uint16), np.array([5], np.uint64), np.ones((1, 4), np.float32), np.array([3], np.uint16))
    orders = [(0, 1, 2), (2, 0, 1), (1, 2, 0)]
    for step, order in enumerate(orders):
        for k, rank in enumerate(order):
            got = srv.receive(f"w{rank}", _step_frames(step, rank, 3, 10 + step, grads=g))
            assert len(got) == (3 if k == 2 else 0)
    arr = srv.stats()["step_barrier"]["arrivals"]
    assert arr["steps"] == 3
    assert [p[:2] for p in arr["per_step"]] == [[0, 2], [1, 1], [2, 0]]
    assert all(p[2] >= p[3] >= 0 for p in arr["per_step"])
    by = {r["rank"]: r for r in arr["by_rank"]}
    assert sorted(by) == [0, 1, 2] and [by[r]["last"] for r in range(3)] == [1, 1, 1]
    assert all(by[r]["own_ms_mean"] is not None and by[r]["own_ms_mean"] >= 0 for r in range(3))
    assert arr["own_ms_std"] is not None
