"""``herald serve worker``: one training worker as its own process."""

from __future__ import annotations

import argparse
import gc
import os
import re

from herald.auth import load_client_keys
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS, DEVICE_PATTERN, MAX_TIMEOUT_MS, MAX_WORKERS
from herald.errors import PeerTimeout, UsageError
from herald.inputs import endpoint_type, int_type, wait_listening


def _from_env(value: int | None, name: str, flag: str, low: int) -> int:
    """``--rank`` / ``--world-size``, else torchrun's ``RANK`` / ``WORLD_SIZE``."""
    if value is not None:
        return value
    text = os.environ.get(name)
    if text is None or not text.strip().isdigit() or not low <= int(text) <= MAX_WORKERS:
        raise UsageError(
            f"herald serve worker needs {flag} (or run it under torchrun, which sets {name}); got {name}={text!r:.40}"
        )
    return int(text)


def _checked(args: argparse.Namespace) -> tuple[int, int]:
    """``herald serve worker``'s flags checked before torch is imported (NOTE [front doors] in
    herald/inputs.py), and the dispatcher found listening within ``--timeout-ms`` (a worker
    with no dispatcher to reach ends naming it, rather than waiting for a job that cannot
    come). Returns ``(rank, world_size)``.

    Raises:
        UsageError: a rank not below the world size. ConfigError: a keys folder without
            usable client keys. PeerTimeout: nothing listens at ``--dispatcher`` within ``--timeout-ms``.
    """
    rank = _from_env(args.rank, "RANK", "--rank", 0)
    world_size = _from_env(args.world_size, "WORLD_SIZE", "--world-size", 1)
    if rank >= world_size:
        raise UsageError(f"--rank {rank} must be below --world-size {world_size} (ranks are 0..N-1)")
    if args.keys is not None:
        load_client_keys(args.keys)  # a folder without usable keys, named with its fix (herald/auth.py)
    if not wait_listening(args.dispatcher, args.timeout_ms / 1000):
        raise PeerTimeout(
            f"no dispatcher listens at --dispatcher {args.dispatcher} (waited {args.timeout_ms} ms): start "
            "herald serve dispatcher there first, or fix the address",
            peer=args.dispatcher,
            op="connect",
        )
    return rank, world_size


def _serve_worker(args: argparse.Namespace) -> int:
    rank, world_size = _checked(args)
    gc.disable()  # NOTE [start-up garbage] in herald/procs.py: on again once run_worker has set up
    from herald.worker.trainer import run_worker  # on use: the herald parser must not load torch (herald/cli.py)

    steps = run_worker(
        args.dispatcher,
        rank,
        world_size,
        device=args.device,
        cache_device=args.cache_device,
        timeout_ms=args.timeout_ms,
        keys_dir=args.keys,
    )
    print(f"worker {rank}: trained {steps} steps")
    return 0


def _device(text: str) -> str:
    """argparse type of ``--device``."""
    if re.fullmatch(DEVICE_PATTERN, text) is None:
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r:.40}")
    return text


def worker_args(
    dispatcher: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    device: str = "auto",
    cache_device: str = "auto",
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    keys_dir: str | None = None,
) -> list[str]:
    """The arguments after the interpreter that start one worker (``-m herald serve worker
    ...``): the one builder of this command line, used by the local and Ray launchers and by
    the test bed (under torchrun, which sets ``RANK`` and ``WORLD_SIZE``: ``rank`` and
    ``world_size`` None)."""
    return [
        "-m", "herald", "serve", "worker", "--dispatcher", dispatcher,
        *(["--rank", str(rank)] if rank is not None else []),
        *(["--world-size", str(world_size)] if world_size is not None else []),
        "--device", device, "--cache-device", cache_device, "--timeout-ms", str(timeout_ms),
        *(["--keys", str(keys_dir)] if keys_dir else []),
    ]  # fmt: skip


def register(commands, bench, serve) -> None:
    """Add ``serve worker``."""
    w = serve.add_parser(
        "worker",
        help="one training worker (connects to a dispatcher)",
        description="Run one training worker: receives scheduled micro-batches from the dispatcher, "
        "keeps the plan-driven embedding cache, talks to the PS shards named by the "
        "dispatcher's job, and all-reduces dense gradients with torch.distributed.",
    )
    w.add_argument(
        "--dispatcher",
        required=True,
        type=endpoint_type(bind=False, flag="--dispatcher"),
        help="dispatcher endpoint, e.g. tcp://127.0.0.1:5555 or ipc:///PATH; it must be listening within --timeout-ms",
    )
    w.add_argument(
        "--rank",
        type=int_type(0, MAX_WORKERS - 1),
        default=None,
        help="this worker's rank, below --world-size (default: $RANK, set by torchrun)",
    )
    w.add_argument(
        "--world-size",
        type=int_type(1, MAX_WORKERS),
        default=None,
        help="number of workers of the job (default: $WORLD_SIZE, set by torchrun)",
    )
    w.add_argument(
        "--device",
        default="auto",
        type=_device,
        help="auto (cuda:LOCAL_RANK %% GPUs when CUDA is available, else cpu), "
        "cpu, cuda or cuda:N (default: %(default)s; docs/worker.md, Devices)",
    )
    w.add_argument(
        "--cache-device",
        default="auto",
        choices=("auto", "cpu", "torch"),
        help="embedding cache: auto (on the GPU when the device is one, else host memory), cpu (host "
        "memory), torch (torch rows on the device, also on the CPU) (default: %(default)s)",
    )
    w.add_argument(
        "--timeout-ms",
        type=int_type(100, MAX_TIMEOUT_MS),
        default=DEFAULT_TIMEOUT_MS,
        help="longest wait for the dispatcher, the PS and the other workers; the wait for the job after "
        "hello lasts at least 60 s however short this is (default: %(default)s)",
    )
    w.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CURVE keys folder (herald keys generate DIR) of a dispatcher and PS run with --keys",
    )
    w.set_defaults(func=_serve_worker)
