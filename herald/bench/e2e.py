"""End-to-end benchmark: samples/s and bytes moved between workers and PS, herald vs vanilla.

Both schedules train the same model on the same synthetic Criteo-shaped stream, in the
same run, with 2 and 4 CPU workers; the stream is long enough for the caches to warm.
Bytes are counted on the wire by the workers (keys + rows/gradients, optimizer state
included), not estimated. ``NAME+replicated`` schedules hold the small tables on every
worker (NOTE [replicated tables]); their all-reduce payload is reported in its own column.

Beside them, in the same run (unless ``--no-torchrec``), the TorchRec baseline
(:mod:`herald.bench.torchrec_baseline`): single-process TorchRec DLRM over FBGEMM's fused
table-batched embeddings, 1 thread, on the same rows, embedding dim, sparse optimizer
(``--optimizer``; FBGEMM has no fused Adam on the CPU) and ``--batch-size`` (one worker's
batch); each herald run's samples/s is also given as a ratio to it. Without torchrec the
JSON's ``"torchrec"`` says ``{"error": "torchrec not installed: make torchrec"}``.
Run as ``herald bench e2e``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from herald.bench import torchrec_baseline
from herald.bench.common import summarize
from herald.bench.table import print_head
from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train


def run(args: argparse.Namespace) -> dict:
    """Every schedule with every worker count, and the TorchRec baseline; prints the table
    and writes ``OUT/bench_e2e.json`` (one entry per ``SCHEDULE-wWORKERS``, and ``"torchrec"``).

    Raises:
        ConfigError: a bad option (an optimizer FBGEMM does not fuse on the CPU: before
            any job runs). HeraldError: a job failed.
    """
    source = args.source or f"synthetic://criteo?rows={args.rows}&seed=1"
    out = pathlib.Path(args.out)
    torchrec_baseline.check_bench_optimizer(args.optimizer, args.no_torchrec)
    results: dict = {}
    for workers in args.workers:
        for schedule in args.schedules:
            name, _, variant = schedule.partition("+")
            cfg = TrainConfig.from_flags(
                source=source,
                schedule=name,
                workers=workers,
                batch_size=args.batch_size,
                cache_ratio=args.cache_ratio,
                embedding_dim=args.embedding_dim,
                optimizer=args.optimizer,
                eval_fraction=0.0,
                replicate_below=args.replicate_below if variant == "replicated" else 0,
                run_dir=str(out / f"{schedule}-w{workers}"),
            )
            print(f"--- {schedule}, {workers} workers", flush=True)
            rep = run_train(cfg, progress=False)
            results[f"{schedule}-w{workers}"] = summarize(rep)
    trec = (
        None
        if args.no_torchrec
        else torchrec_baseline.torchrec_on_source(
            source,
            batch_size=args.batch_size,
            eval_fraction=0.0,
            embedding_dim=args.embedding_dim,
            optimizer=args.optimizer,
        )
    )
    _print_table(args, results, trec)
    print(f"\n{torchrec_baseline.describe(trec)} (batch {args.batch_size}, one herald worker's)")
    results["torchrec"] = trec
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_e2e.json").write_text(json.dumps(results, indent=2))
    print(f"\nwritten {out / 'bench_e2e.json'}")
    return results


def _print_table(args: argparse.Namespace, results: dict, trec) -> None:
    """The markdown table of every run against vanilla (same worker count) and TorchRec
    (``trec``); adds the ratios to each run's entry of ``results``."""
    print_head(
        "workers | schedule | samples/s | worker<->PS MiB | embeddings moved | bytes vs vanilla | all-reduce MiB "
        "| time vs vanilla | vs TorchRec"
    )
    for workers in args.workers:
        base = results.get(f"vanilla-w{workers}")
        for schedule in args.schedules:
            r = results[f"{schedule}-w{workers}"]
            ratio = r["wire_bytes"] / base["wire_bytes"] if base else float("nan")
            tratio = r["train_seconds"] / base["train_seconds"] if base else float("nan")
            r["bytes_ratio_vs_vanilla"], r["time_ratio_vs_vanilla"] = ratio, tratio
            r["ratio_vs_torchrec"] = torchrec_baseline.ratio_to(trec, r["samples_per_second"])
            print(
                f"| {workers} | {schedule} | {r['samples_per_second']:,.0f} | {r['wire_bytes'] / 2**20:,.1f} | "
                f"{r['embeddings_moved']:,} | {ratio:.3f}x | {r['allreduce_bytes'] / 2**20:,.1f} | {tratio:.3f}x | "
                f"{torchrec_baseline.format_ratio(r['ratio_vs_torchrec'])} |"
            )
