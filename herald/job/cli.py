"""``herald train`` and ``herald bench e2e``; the job arguments shared with ``herald serve dispatcher``."""

from __future__ import annotations

import argparse

from herald.config import key_value, parse_value

SCHEDULES_HELP = "herald (LAIA + communication plan), laia, plan, vanilla (random + full-set sync), or our policy"


def _source_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with the value converted by :func:`herald.config.parse_value`."""
    key, value = key_value(text)
    return key, parse_value(value)


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    from herald.job.spec import DEFAULT_SOURCE, TrainConfig

    d = TrainConfig()
    p.add_argument("--source", default=DEFAULT_SOURCE,
                   help="input: a file (Criteo .tsv, Avazu .csv, MovieLens ratings.csv or u.data, Frappe .libfm, "
                        "herald .parquet) or synthetic://criteo?rows=N&seed=S (default: %(default)s)")
    p.add_argument("--source-option", action="append", type=_source_option, default=[], metavar="KEY=VALUE",
                   help="an option of the source (e.g. bad_records=skip, threshold=4); repeatable")
    p.add_argument("--schedule", default=d.schedule, help=f"{SCHEDULES_HELP} (default: %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers, help="number of workers (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="samples per worker per step; global batch = workers x batch size (default: %(default)s)")
    p.add_argument("--cache-ratio", type=float, default=d.cache_ratio,
                   help="worker cache size as a fraction of the distinct keys in the training split "
                        "(default: %(default)s)")
    p.add_argument("--cache-rows", type=int, default=None,
                   help="worker cache size in rows (overrides --cache-ratio; default for a kafka:// stream: 100000)")
    p.add_argument("--cache-policy", default=d.cache_policy, choices=["lru", "lfu"], help="(default: %(default)s)")
    p.add_argument("--embedding-dim", type=int, default=d.embedding_dim, help="(default: %(default)s)")
    p.add_argument("--optimizer", default=d.optimizer, choices=["sgd", "adagrad", "rowwise_adagrad", "adam"],
                   help="sparse optimizer of the embeddings (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="sparse learning rate (default: %(default)s)")
    p.add_argument("--dense-optimizer", default=d.dense_optimizer, choices=["sgd", "adagrad", "adam"],
                   help="(default: %(default)s)")
    p.add_argument("--dense-lr", type=float, default=d.dense_lr, help="(default: %(default)s)")
    p.add_argument("--model", default=d.model, choices=["auto", "dlrm", "ncf"],
                   help="auto = NCF for two tables without dense features, else DLRM (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: all data)")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction,
                   help="the last fraction of the rows is held out for evaluation (default: %(default)s)")
    p.add_argument("--ps-shards", type=int, default=d.ps_shards, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    p.add_argument("--timeout-ms", type=int, default=d.timeout_ms,
                   help="longest wait for any peer before it is reported by name (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="STEPS",
                   help="checkpoint PS rows, dense state and source position every STEPS steps; kafka:// sources "
                        "commit their offsets only with a checkpoint (0: at the end only for kafka://, "
                        "never for files; default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="continue a kafka:// job from the latest checkpoint in --run-dir")
    p.add_argument("--eval-every", type=int, default=d.eval_every, metavar="STEPS",
                   help="print progressive validation (AUC, log loss of predictions made before each update) "
                        "every STEPS steps (default: %(default)s)")
    p.add_argument("--replicate-below", type=int, default=d.replicate_below, metavar="IDS",
                   help="hold every table with at most IDS distinct ids (training split) whole on every worker, "
                        "synchronised by all-reduce instead of the PS (hybrid embeddings; 0: off; default: "
                        "%(default)s)")
    p.add_argument("--log-sample-ids", action="store_true",
                   help="append the sample ids of every trained step to RUN_DIR/trained_sample_ids.u64")


def config_from_args(args: argparse.Namespace):
    from herald.job.spec import TrainConfig

    return TrainConfig(source=args.source, schedule=args.schedule, workers=args.workers, batch_size=args.batch_size,
                       cache_ratio=args.cache_ratio, cache_rows=args.cache_rows, cache_policy=args.cache_policy,
                       embedding_dim=args.embedding_dim, optimizer=args.optimizer, lr=args.lr,
                       dense_optimizer=args.dense_optimizer, dense_lr=args.dense_lr, model=args.model,
                       epochs=args.epochs, steps=args.steps, eval_fraction=args.eval_fraction,
                       ps_shards=args.ps_shards, seed=args.seed, run_dir=getattr(args, "run_dir", "runs/latest"),
                       timeout_ms=args.timeout_ms, checkpoint_every=args.checkpoint_every, resume=args.resume,
                       eval_every=args.eval_every, log_sample_ids=args.log_sample_ids,
                       replicate_below=args.replicate_below,
                       source_options=tuple(args.source_option))


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
    p.add_argument("--run-dir", default="runs/latest", help="where logs and the report go (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)

    register_bench(bench)


def register_bench(bench) -> None:
    from herald.job import bench as bench_mod

    b = bench.add_parser("e2e", help="herald vs vanilla end to end: samples/s and bytes moved (same run)",
                         description=bench_mod.__doc__)
    bench_mod.add_arguments(b)
    b.set_defaults(func=lambda args: (bench_mod.run(args), 0)[1])
