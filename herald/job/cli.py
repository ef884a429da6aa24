"""``herald train``; the job arguments shared with ``herald serve dispatcher``."""

from __future__ import annotations

import argparse

from herald.config import add_arguments, from_arguments
from herald.contracts.train import TrainConfig


def add_job_arguments(p: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
    """The options of :class:`herald.contracts.train.TrainConfig` (shared by ``herald train``
    and ``herald serve dispatcher``)."""
    add_arguments(p, TrainConfig, exclude=exclude)


def config_from_args(args: argparse.Namespace):
    """The :class:`~herald.contracts.train.TrainConfig` of parsed job options."""
    return from_arguments(TrainConfig, args)


def _train(args: argparse.Namespace) -> int:
    from herald.job.launcher import run_train  # on use: the parser must not load torch (~3 s: herald/cli.py)
    from herald.job.runner import process_started_at

    run_train(config_from_args(args), progress=not args.quiet, started_at=process_started_at())
    return 0


def register(commands, bench, serve) -> None:
    """Add ``train``."""
    p = commands.add_parser(
        "train",
        help="the main job: PS shard(s), a dispatcher and N workers as local processes (or Ray actors: --launcher ray)",
        description="Train a recommendation model with scheduled micro-batches: starts PS shard(s), the dispatcher "
        "and N worker processes, trains (exactly by default: --consistency bsp; bounded, hybrid and gba "
        "relax it), evaluates on the held-out split and writes a "
        "report (text, JSON, PNG). With no arguments it trains DLRM on a synthetic Criteo-shaped stream "
        "with 2 workers.",
    )
    add_job_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)
