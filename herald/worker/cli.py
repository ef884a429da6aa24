"""``herald serve worker``: one training worker as its own process."""

from __future__ import annotations

import argparse


def _serve_worker(args: argparse.Namespace) -> int:
    from herald.worker.trainer import run_worker

    steps = run_worker(args.dispatcher, args.rank, args.world_size, device=args.device, timeout_ms=args.timeout_ms)
    print(f"worker {args.rank}: trained {steps} steps")
    return 0


def register(commands, bench, serve) -> None:
    """Add ``serve worker``."""
    w = serve.add_parser("worker", help="one training worker (connects to a dispatcher)",
                         description="Run one training worker: receives scheduled micro-batches from the dispatcher, "
                                     "keeps the plan-driven embedding cache, talks to the PS shards named by the "
                                     "dispatcher's job, and all-reduces dense gradients with torch.distributed.")
    w.add_argument("--dispatcher", required=True, help="dispatcher endpoint, e.g. tcp://127.0.0.1:5555")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--world-size", type=int, required=True)
    w.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    w.add_argument("--timeout-ms", type=int, default=120_000)
    w.set_defaults(func=_serve_worker)
