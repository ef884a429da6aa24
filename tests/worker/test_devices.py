"""Device and backend choice (NOTE [worker devices]) with fake GPU counts, the cache
choice, and the group each collective runs in."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from herald.errors import ConfigError, HeraldError
from herald.worker import devices
from herald.worker.devices import (
    choose_device,
    local_ranks,
    parse_device,
    resolve_cache_device,
)


def _choice(requested, cuda_count, *, rank=0, world=1, local_rank=None, local_world=None):
    return choose_device(
        rank,
        rank if local_rank is None else local_rank,
        world,
        world if local_world is None else local_world,
        requested,
        cuda_count,
    )


@pytest.mark.parametrize(
    "requested,cuda,rank,world,device,backend",
    [
        ("auto", 0, 0, 1, "cpu", "gloo"),
        (None, 0, 1, 4, "cpu", "gloo"),
        ("cpu", 8, 3, 4, "cpu", "gloo"),  # cpu even with GPUs
        ("auto", 1, 0, 1, "cuda:0", "nccl"),  # one worker, one GPU
        ("auto", 4, 2, 4, "cuda:2", "nccl"),  # one GPU per rank
        ("cuda", 8, 3, 4, "cuda:3", "nccl"),
        ("auto", 1, 1, 2, "cuda:0", "gloo"),  # two ranks share the only GPU: no NCCL
        ("auto", 2, 3, 4, "cuda:1", "gloo"),  # 4 ranks round-robin on 2 GPUs
        ("cuda:1", 2, 0, 1, "cuda:1", "nccl"),  # one rank, the GPU it asked for
        ("cuda:0", 4, 1, 2, "cuda:0", "gloo"),  # every rank given the same GPU
    ],
)
def test_device_and_backend_follow_the_torchrun_rule(requested, cuda, rank, world, device, backend):
    got = _choice(requested, cuda, rank=rank, world=world)
    assert (str(got.device), got.backend) == (device, backend)
    assert (got.notice is not None) == (backend == "gloo" and world > 1)


def test_local_rank_picks_the_gpu_and_local_world_size_the_backend():
    # 2 hosts x 2 ranks, 2 GPUs each: global rank 3 is local rank 1 -> cuda:1, NCCL
    got = choose_device(3, 1, 4, 2, "auto", 2)
    assert (str(got.device), got.backend, got.notice) == ("cuda:1", "nccl", None)
    # 2 hosts x 4 ranks, 2 GPUs each: shared on each host -> gloo on every rank
    assert {choose_device(r, r % 4, 8, 4, "auto", 2).backend for r in range(8)} == {"gloo"}


def test_the_notice_says_why_and_how_to_get_nccl():
    shared = _choice("auto", 1, rank=0, world=3)
    assert "3 ranks on this host share 1 GPU(s)" in shared.notice and "NCCL" in shared.notice
    assert "gloo" in _choice("cpu", 0, rank=0, world=2).notice


@pytest.mark.parametrize(
    "requested,cuda,message",
    [
        ("cuda", 0, "needs CUDA, but no GPU is visible"),
        ("cuda:0", 0, "needs CUDA"),
        ("cuda:2", 2, r"only 2 GPU\(s\) are visible"),
        ("gpu", 1, "not one of auto, cpu, cuda, cuda:N"),
        ("cuda:", 1, "not one of"),
        ("cuda:-1", 1, "not one of"),
    ],
)
def test_impossible_devices_raise_naming_the_fix(requested, cuda, message):
    with pytest.raises(ConfigError, match=message):
        _choice(requested, cuda)


def test_ranks_out_of_range_raise():
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        choose_device(0, 2, 4, 2, "auto", 2)
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        choose_device(4, 0, 4, 4, "auto", 2)


def test_parse_and_local_ranks():
    assert parse_device(None) == ("auto", None) and parse_device("cuda:12") == ("cuda", 12)
    assert local_ranks(3, 4, {}) == (3, 4)
    assert local_ranks(3, 4, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (1, 2)
    with pytest.raises(ConfigError, match="integers"):
        local_ranks(0, 1, {"LOCAL_RANK": "x"})


def test_select_device_on_this_machine_without_cuda_is_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # the rule itself is covered with fake counts above
    assert devices.select_device(0, 1, "auto", env={}) == (torch.device("cpu"), "gloo", None)


@pytest.mark.parametrize(
    "cache_device,device,kind",
    [
        ("auto", "cpu", "host"),
        ("auto", "cuda:1", "torch"),
        ("cpu", "cuda:0", "host"),
        ("torch", "cpu", "torch"),
        ("torch", "cuda:0", "torch"),
    ],
)
def test_cache_device_resolves_to_an_implementation(cache_device, device, kind):
    assert resolve_cache_device(cache_device, torch.device(device)) == kind


def test_unknown_cache_device_raises():
    with pytest.raises(ConfigError, match="auto, cpu, torch"):
        resolve_cache_device("gpu", torch.device("cpu"))


def test_cpu_tensors_go_to_the_gloo_side_group_under_nccl(monkeypatch):
    """With a fake NCCL default group: CPU tensors need the side group, others use the default."""
    world = object()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(devices, "_world", lambda: world)
    monkeypatch.setattr(devices, "_side", {})
    with pytest.raises(HeraldError, match="setup_collectives"):
        devices.group_for(torch.zeros(1))
    side = object()
    monkeypatch.setattr(devices, "_side", {"world": world, "gloo": side})
    assert devices.group_for(torch.zeros(1)) is side
    assert devices.group_for(torch.zeros(1, device="meta")) is None  # a device tensor: the NCCL group


def test_gloo_needs_no_side_group(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert devices.group_for(torch.zeros(1)) is None
    devices.setup_collectives()  # no process group: nothing to do, no error


def test_herald_train_checks_device_settings_naming_the_flag():
    from herald.contracts.train import TrainConfig

    assert (
        TrainConfig.from_flags(device="cuda:3").device,
        TrainConfig.from_flags(cache_device="torch").cache.device,
    ) == ("cuda:3", "torch")
    with pytest.raises(ConfigError, match="--device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        TrainConfig.from_flags(device="gpu")
    with pytest.raises(ConfigError, match="--cache-device must be one of auto, cpu, torch, got 'gpu'"):
        TrainConfig.from_flags(cache_device="gpu")
