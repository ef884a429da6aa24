"""``herald serve worker``: one training worker as its own process."""

from __future__ import annotations

import argparse
import gc
import os

from herald.contracts.vocab import DEFAULT_TIMEOUT_MS
from herald.errors import ConfigError


def _from_env(value: int | None, name: str, flag: str) -> int:
    """``--rank`` / ``--world-size``, else torchrun's ``RANK`` / ``WORLD_SIZE``."""
    if value is not None:
        return value
    text = os.environ.get(name)
    if text is None or not text.strip().isdigit():
        raise ConfigError(
            f"herald serve worker needs {flag} (or run it under torchrun, which sets {name}); got {name}={text!r}"
        )
    return int(text)


def _serve_worker(args: argparse.Namespace) -> int:
    gc.disable()  # NOTE [start-up garbage] in herald/procs.py: on again once run_worker has set up
    from herald.worker.trainer import run_worker  # on use: the herald parser must not load torch (herald/cli.py)

    rank = _from_env(args.rank, "RANK", "--rank")
    world_size = _from_env(args.world_size, "WORLD_SIZE", "--world-size")
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
    w.add_argument("--dispatcher", required=True, help="dispatcher endpoint, e.g. tcp://127.0.0.1:5555")
    w.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $RANK, set by torchrun)")
    w.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of workers of the job (default: $WORLD_SIZE, set by torchrun)",
    )
    w.add_argument(
        "--device",
        default="auto",
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
        type=int,
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
