"""``herald train`` and ``herald bench e2e|scale|network``; the job arguments shared with ``herald serve dispatcher``."""

from __future__ import annotations

import argparse

from herald.config import add_arguments, from_arguments

def add_job_arguments(p: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
    """The options of :class:`herald.spec.train.TrainConfig` (shared by ``herald train``
    and ``herald serve dispatcher``)."""
    from herald.spec.train import TrainConfig

    add_arguments(p, TrainConfig, exclude=exclude)


def config_from_args(args: argparse.Namespace):
    """The :class:`~herald.spec.train.TrainConfig` of parsed job options."""
    from herald.spec.train import TrainConfig

    return from_arguments(TrainConfig, args)


def _train(args: argparse.Namespace) -> int:
    from herald.job.launcher import run_train

    run_train(config_from_args(args), progress=not args.quiet)
    return 0


def register(commands, bench, serve) -> None:
    """Add ``train`` and ``bench e2e``."""
    p = commands.add_parser(
        "train", help="the main job: PS shard(s), a dispatcher and N workers as local processes",
        description="Train a recommendation model with scheduled micro-batches: starts PS shard(s), the dispatcher "
                    "and N worker processes, trains exactly (BSP), evaluates on the held-out split and writes a "
                    "report (text, JSON, PNG). With no arguments it trains DLRM on a synthetic Criteo-shaped stream "
                    "with 2 workers.")
    add_job_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)

    register_bench(bench)


def register_bench(bench) -> None:
    from herald.job import bench as bench_mod

    b = bench.add_parser("e2e", help="herald vs vanilla end to end: samples/s and bytes moved (same run)",
                         description=bench_mod.__doc__)
    bench_mod.add_arguments(b)
    b.set_defaults(func=lambda args: (bench_mod.run(args), 0)[1])

    from herald.job import bench_scale

    b = bench.add_parser("scale", help="herald with 1, 2, 4, ... workers vs plain single-process PyTorch "
                                       "(samples/s, scaling factor, phases; same run)",
                         description=bench_scale.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_scale.add_arguments(b)
    b.set_defaults(func=lambda args: (bench_scale.run(args), 0)[1])

    from herald.job import bench_network

    b = bench.add_parser("network", help="vanilla, laia, plan, herald, costaware across hosts with shaped links "
                                         "(network-namespace test bed, root; samples/s, bytes, AUC; same run)",
                         description=bench_network.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_network.add_arguments(b)
    b.set_defaults(func=lambda args: (bench_network.run(args), 0)[1])

    from herald.job import bench_comm

    bench_comm.register(bench)   # compression, groups (docs/compression.md)

    from herald.job import bench_consistency

    bench_consistency.register(bench)   # consistency modes with and without a straggler (docs/consistency.md)

    from herald.worker import bench_kernels

    bench_kernels.register(bench)   # worker cache hot path vs FBGEMM TBE, one thread (issue 16)
