"""Which device a worker trains on, which torch.distributed backend its group uses,
where its embedding cache lives, and which group each collective runs in.

NOTE [worker devices] (docs/worker.md, "Devices"). The rule torchrun users expect:

- ``auto``: ``cuda:LOCAL_RANK % device_count`` when CUDA is available, else ``cpu``;
  ``cuda``: the same GPU, but CUDA is required; ``cuda:N``: GPU N for this rank;
  ``cpu``: the CPU. ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` come from torchrun's
  environment (``herald train`` sets them for its workers); without them the rank is
  taken as the rank on this host (every rank on one host).
- NCCL only when every rank on the host has a GPU of its own: the device is CUDA,
  picked per rank (``auto``/``cuda``) and ``LOCAL_WORLD_SIZE <= device_count``. When
  ranks share a GPU (more ranks than GPUs, or one ``cuda:N`` given to every rank) or
  run on the CPU, gloo (NCCL rejects two ranks on one GPU: "Duplicate GPU detected").
  The decision depends only on values every rank of a host sees equally, so all ranks
  agree on the backend.
- ``torch.cuda.set_device`` runs before the process group is created (NCCL binds the
  current device).
- Every collective runs in a group that handles its tensors: with NCCL, CPU tensors
  (the replicated tables' all-reduce) go to a gloo side group created once on every
  rank by :func:`setup_collectives`; gloo handles CPU and CUDA tensors itself.
- The embedding cache (``cache_device``): ``auto`` = the torch cache on the device
  when the device is a GPU, else the host (numpy) cache; ``cpu`` = the host cache
  (caches larger than GPU memory); ``torch`` = the torch cache on the training device
  even on the CPU (how CI tests it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from herald.contracts.vocab import CACHE_DEVICES, DEVICE_PATTERN
from herald.errors import ConfigError, HeraldError


class DeviceChoice(NamedTuple):
    """Result of :func:`choose_device`.

    Attributes:
        device: this rank's training device.
        backend: ``"nccl"`` or ``"gloo"`` (the same on every rank of the job).
        notice: one line for the log when gloo was chosen for several ranks, else None.
    """

    device: torch.device
    backend: str
    notice: str | None


def parse_device(requested: str | None) -> tuple[str, int | None]:
    """``(kind, index)`` of a ``--device`` value: kind ``auto``/``cpu``/``cuda``, index the
    ``N`` of ``cuda:N`` (else None). None means ``auto``.

    Raises:
        ConfigError: any other text (the message lists the accepted forms).
    """
    text = "auto" if requested is None else str(requested).strip()
    if not re.fullmatch(DEVICE_PATTERN, text):
        raise ConfigError(f"--device {requested!r} is not one of auto, cpu, cuda, cuda:N")
    kind, _, index = text.partition(":")
    return kind, (int(index) if index else None)


def choose_device(
    rank: int, local_rank: int, world_size: int, local_world_size: int, requested: str | None, cuda_count: int
) -> DeviceChoice:
    """This rank's device and the job's backend (NOTE [worker devices]); pure, no CUDA call.

    Args:
        rank, world_size: the rank among all workers, and their number.
        local_rank, local_world_size: the rank among the workers of this host, and their number.
        requested: ``auto`` (or None), ``cpu``, ``cuda`` or ``cuda:N``.
        cuda_count: GPUs visible to this process (0 when CUDA is not available).

    Raises:
        ConfigError: CUDA requested but no GPU visible, ``cuda:N`` beyond the visible
            GPUs, or ranks out of range.
    """
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        raise ConfigError(
            f"need 0 <= rank {rank} < world_size {world_size} and 0 <= local_rank {local_rank} < "
            f"local_world_size {local_world_size} <= world_size (check LOCAL_RANK / LOCAL_WORLD_SIZE)"
        )
    kind, index = parse_device(requested)
    if kind == "cuda" and cuda_count < 1:
        raise ConfigError(
            f"--device {requested} needs CUDA, but no GPU is visible (torch.cuda.device_count() == 0): "
            "use --device auto or cpu, or check CUDA_VISIBLE_DEVICES and the driver"
        )
    if index is not None and index >= cuda_count:
        raise ConfigError(
            f"--device {requested}: only {cuda_count} GPU(s) are visible (cuda:0..cuda:{cuda_count - 1}): "
            "choose one of them, or --device cuda (one GPU per worker) or auto"
        )
    if kind == "cpu" or (kind == "auto" and cuda_count < 1):
        notice = f"{world_size} workers on the CPU: gloo all-reduce" if world_size > 1 else None
        return DeviceChoice(torch.device("cpu"), "gloo", notice)
    if index is not None:
        shared = local_world_size > 1  # the same cuda:N is given to every rank of the host
        device = torch.device("cuda", index)
    else:
        shared = local_world_size > cuda_count
        device = torch.device("cuda", local_rank % cuda_count)
    if not shared:
        return DeviceChoice(device, "nccl", None)
    notice = None
    if world_size > 1:
        why = (
            f"every rank was given {requested}"
            if index is not None
            else f"{local_world_size} ranks on this host share {cuda_count} GPU(s)"
        )
        notice = (
            f"{why}: gloo all-reduce (NCCL needs one GPU per rank; use --device cuda with <= {cuda_count} "
            "workers per host for NCCL)"
        )
    return DeviceChoice(device, "gloo", notice)


def local_ranks(rank: int, world_size: int, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(local_rank, local_world_size)`` from torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``,
    else ``(rank, world_size)`` (every rank on this host).

    Raises:
        ConfigError: a variable that is not an integer.
    """
    env = os.environ if env is None else env
    try:
        return int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        raise ConfigError(
            f"LOCAL_RANK / LOCAL_WORLD_SIZE must be integers, got {env.get('LOCAL_RANK')!r} / "
            f"{env.get('LOCAL_WORLD_SIZE')!r}"
        ) from None


def visible_gpus() -> int:
    """GPUs this process may use: ``torch.cuda.device_count()`` when CUDA is available, else 0."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(requested: str | None, local_world_size: int, cuda_count: int | None = None) -> None:
    """Refuse, before any worker starts, a ``--device`` that the workers of this host cannot
    train on: what :func:`select_device` would raise in each of the ``local_world_size``
    workers (``herald train``'s local workers: :meth:`herald.job.parts.LocalWorkers.prepare`).
    ``auto`` and ``cpu`` ask nothing of CUDA (no CUDA call); ``cuda`` and ``cuda:N`` ask
    :func:`visible_gpus` (``cuda_count``, when given, instead: tests).

    Raises:
        ConfigError: as :func:`choose_device` (CUDA asked for and no GPU visible, or
            ``cuda:N`` beyond the visible GPUs), naming ``--device``.
    """
    kind, _ = parse_device(requested)
    if kind != "cuda":
        return
    count = visible_gpus() if cuda_count is None else cuda_count
    choose_device(0, 0, local_world_size, local_world_size, requested, count)


def select_device(
    rank: int, world_size: int, requested: str | None, env: Mapping[str, str] | None = None
) -> DeviceChoice:
    """:func:`choose_device` for this process (:func:`visible_gpus`, torchrun's environment),
    then ``torch.cuda.set_device`` when the device is a GPU: call before the process group.

    Raises:
        ConfigError: as :func:`choose_device`.
    """
    local_rank, local_world_size = local_ranks(rank, world_size, env)
    choice = choose_device(rank, local_rank, world_size, local_world_size, requested, visible_gpus())
    if choice.device.type == "cuda":
        torch.cuda.set_device(choice.device)
    return choice


def resolve_cache_device(cache_device: str, device: torch.device) -> str:
    """Which cache implementation a worker on ``device`` keeps: ``"host"`` (numpy rows,
    the PS's numba kernels) or ``"torch"`` (torch rows on ``device``).

    Args:
        cache_device: ``auto``, ``cpu`` or ``torch`` (NOTE [worker devices]).

    Raises:
        ConfigError: another value.
    """
    if cache_device not in CACHE_DEVICES:
        raise ConfigError(f"cache device {cache_device!r} is not one of {', '.join(CACHE_DEVICES)}")
    if cache_device == "auto":
        return "torch" if device.type == "cuda" else "host"
    return "host" if cache_device == "cpu" else "torch"


# ------------------------------------------------------------------ collective groups

_side: dict[str, object] = {}  # {"world": the default group it belongs to, "gloo": the side group}


def _world():
    """The default process group (a new one after destroy + init: the side group is remade)."""
    return dist.group.WORLD


def setup_collectives() -> None:
    """Create the gloo side group for CPU tensors when the default group is NCCL.

    A collective call: every rank runs it once, right after ``init_process_group``
    (:meth:`herald.worker.dense_group.DenseGroup.join` does). Idempotent; does nothing
    without a process group or with gloo.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    if _side.get("world") is not _world():
        _side["gloo"] = dist.new_group(backend="gloo")
        _side["world"] = _world()


def group_for(tensor: torch.Tensor):
    """The process group to all-reduce ``tensor`` in: None (the default group) unless the
    default group is NCCL and ``tensor`` is on the CPU; then the gloo side group.

    Raises:
        HeraldError: NCCL, a CPU tensor, and :func:`setup_collectives` was not called.
    """
    if tensor.device.type != "cpu" or dist.get_backend() != "nccl":
        return None
    if _side.get("world") is not _world():
        raise HeraldError(
            "a CPU tensor is all-reduced in an NCCL group and no gloo side group exists: call "
            "herald.worker.devices.setup_collectives() on every rank after init_process_group"
        )
    return _side["gloo"]
