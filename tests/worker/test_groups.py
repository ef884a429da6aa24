"""NOTE [training groups]: EASGD arithmetic against a numpy reference, a dying averaging
thread reported by name, the group layout, and DenseSync's compressed / grouped
all-reduce in real gloo process groups (4 ranks on loopback)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from herald.contracts.comm import check_comm
from herald.errors import ConfigError
from herald.worker.groups import (
    GroupAverager,
    GroupAveragingFailed,
    GroupLayout,
    easgd_round,
)
from tests.fakes import thread_all_reduce


def _numpy_easgd(replicas, center, alpha):
    """EASGD (Zhang et al. 2015), one synchronous elastic round over G replicas."""
    diffs = [x - center for x in replicas]
    return [x - alpha * d for x, d in zip(replicas, diffs)], center + alpha * np.sum(diffs, axis=0)


def test_layout():
    lay = GroupLayout(8, 2)
    assert lay.size == 4 and lay.ranks(1) == [4, 5, 6, 7] and lay.leaders() == [0, 4] and lay.group_of(5) == 1
    assert lay.describe(1) == "group 1 (ranks 4-7)"
    with pytest.raises(ConfigError, match="divide"):
        GroupLayout(6, 4)


def test_settings_checked_with_flag_names():
    check_comm("int8", "bf16", 2, 5, 0.5, workers=4)
    for args, flag in [
        (("fp8", "fp32", 1, 1, 0.5), "--wire-dtype"),
        (("fp32", "int8", 1, 1, 0.5), "--dense-comm"),
        (("fp32", "fp32", 0, 1, 0.5), "--groups"),
        (("fp32", "fp32", 1, 0, 0.5), "--average-every"),
        (("fp32", "fp32", 1, 1, 1.0), "--easgd-alpha"),
    ]:
        with pytest.raises(ConfigError, match=flag):
            check_comm(*args)
    with pytest.raises(ConfigError, match="divide --workers 3"):
        check_comm("fp32", "fp32", 2, 1, 0.5, workers=3)


def test_easgd_round_matches_numpy_reference():
    rng = np.random.default_rng(0)
    replicas = [rng.standard_normal(7).astype(np.float32) for _ in range(3)]
    center = rng.standard_normal(7).astype(np.float32)
    alpha = 0.3
    want_x, want_c = _numpy_easgd(replicas, center, alpha)
    diffs = [torch.from_numpy(x - center) for x in replicas]
    got_x, got_c = [], []
    for x in replicas:
        c = torch.from_numpy(center.copy())
        delta = easgd_round(torch.from_numpy(x), c, alpha, lambda t: t.copy_(sum(diffs)))
        got_x.append(x - delta.numpy())
        got_c.append(c.numpy())
    for g in range(3):
        np.testing.assert_allclose(got_x[g], want_x[g], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got_c[g], want_c, rtol=0, atol=1e-6)


def test_averagers_in_threads_match_numpy_over_rounds():
    """Three leaders' threads, two rounds each: corrections and centers equal the numpy EASGD."""
    rng = np.random.default_rng(1)
    lay, alpha = GroupLayout(6, 3), 0.25
    center0 = rng.standard_normal(5).astype(np.float32)
    reduce = thread_all_reduce(3)  # tests/fakes.py
    avgs = [GroupAverager(lay, g, torch.from_numpy(center0), alpha, reduce) for g in range(3)]
    xs, c = [center0 + rng.standard_normal(5).astype(np.float32) for _ in range(3)], center0
    try:
        for round_ in range(2):
            for g, a in enumerate(avgs):
                a.submit(10 * (round_ + 1), torch.from_numpy(xs[g]))
            want_x, c = _numpy_easgd(xs, c, alpha)
            for g, a in enumerate(avgs):
                delta, read = _wait_correction(a)
                assert read == 10 * (round_ + 1)
                xs[g] = xs[g] - delta.numpy()
                np.testing.assert_allclose(xs[g], want_x[g], atol=1e-6)
                np.testing.assert_allclose(a.center.numpy(), c, atol=1e-6)
    finally:
        for a in avgs:
            a.close(5.0)
        assert all(a.ended for a in avgs)
    assert [a.rounds for a in avgs] == [2, 2, 2]


def _wait_correction(averager, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        delta, read = averager.take_correction()
        if delta is not None:
            return delta, read
        time.sleep(0.005)
    raise AssertionError("no correction within the timeout")


def test_dead_averaging_thread_is_reported_by_name():
    def broken(t):
        raise RuntimeError("leader 0 left the leaders' group")

    a = GroupAverager(GroupLayout(4, 2), 1, torch.zeros(3), 0.5, broken)
    a.submit(5, torch.ones(3))
    deadline = time.monotonic() + 10
    while a._error is None and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(GroupAveragingFailed, match=r"group 1 \(ranks 2-3\).*leader 0 left"):
        a.take_correction()
    with pytest.raises(GroupAveragingFailed, match="group 1"):
        a.submit(10, torch.ones(3))
    a.close(5.0)
    assert a.ended


def test_busy_rounds_are_coalesced_not_dropped():
    gate = threading.Event()

    def slow(t):
        gate.wait(10)

    a = GroupAverager(GroupLayout(2, 2), 0, torch.zeros(2), 0.5, slow)
    for step in (1, 2, 3):
        a.submit(step, torch.full((2,), float(step)))
    gate.set()
    a.close(10.0)
    assert a.ended
    assert a.rounds == 3 and a.coalesced >= 1  # every round ran; queued ones used the newest copy


# ------------------------------------------------------ real gloo groups
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, groups, dense_comm, out):
    from herald.worker.dense import DenseSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        sync = DenseSync(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            world,
            dense_comm=dense_comm,
            rank=rank,
            groups=groups,
            average_every=2,
            easgd_alpha=0.5,
        )
        gen = torch.Generator().manual_seed(100 + (rank // (world // groups)) * 7 + rank)
        for _ in range(12):
            x = torch.randn(8, 4, generator=gen)
            loss = (model(x).squeeze(1) - x.sum(1) * (1 + rank)).pow(2).mean()
            loss.backward()
            sync.step()
        averager = sync.groups.averager if sync.groups is not None else None
        if averager is not None:  # a leader: wait until its thread ran every round submitted (one every
            deadline = time.monotonic() + 60  # 2 steps), then one more step applies their correction
            while averager.rounds < 12 // 2:
                averager.check()
                assert time.monotonic() < deadline, f"rank {rank}: {averager.rounds} of 6 EASGD rounds after 60 s"
                time.sleep(0.01)
        x = torch.randn(8, 4, generator=gen)
        model(x).pow(2).mean().backward()
        sync.step()
        sync.close(20.0)
        stats = sync.background_stats()
        out[rank] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(), stats)
    finally:
        dist.destroy_process_group()


def _run_ranks(world, groups, dense_comm):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, groups, dense_comm, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return dict(out)


@pytest.mark.integration
@pytest.mark.slow  # ~42 s (2 shared cores): 4 spawned gloo ranks, twice
def test_dense_sync_groups_and_compression_in_gloo():
    fp32 = _run_ranks(4, 1, "fp32")
    assert all(np.array_equal(fp32[r][0], fp32[0][0]) for r in range(4)) and fp32[0][1] is None
    grouped = _run_ranks(4, 2, "fp16")  # groups, and the fp16 payload in the group all-reduce
    assert np.array_equal(grouped[0][0], grouped[1][0]) and np.array_equal(grouped[2][0], grouped[3][0])
    assert not np.array_equal(grouped[0][0], grouped[2][0])  # two replicas
    lead = grouped[0][1]
    assert lead["group"] == 0 and lead["rounds"] == 6 and lead["corrections"] >= 1 and lead["thread_ended"]
    assert lead["lag_steps_max"] >= 1 and grouped[1][1]["rounds"] == 0
