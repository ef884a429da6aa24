"""Scaling benchmark: herald with 1, 2, 4, ... workers against plain single-process PyTorch.

In one run, on the same rows (the training split of ``--source``, by default a synthetic
Criteo-shaped stream of ``--rows`` rows: 13 dense features, 26 tables):

1. **plain PyTorch**, the baseline a user would write: herald's DLRM
   (:func:`herald.worker.models.build_model`, same dense dim, 26 tables, embedding dim 16,
   seed) with one ``nn.EmbeddingBag(rows_t, 16, mode="sum", sparse=True)`` per table,
   ``torch.optim.Adagrad`` (lr = herald's default sparse lr, eps = herald's) on the
   embeddings and ``torch.optim.Adam`` (herald's default dense lr) on the rest, batch
   ``--batch-size``, 1 torch thread, mean BCE loss. Table ``t`` has exactly as many rows
   as the training split has distinct ids in table ``t`` (ids remapped to 0..rows_t-1 by
   ``np.unique``: no hash collisions, the same parameters herald's PS ends up holding;
   the synthetic cardinalities, up to 10M per table, would not fit in memory). The
   batches are read through herald's loader (``GlobalBatches`` over the same training
   split) and remapped *before* timing (read and remap seconds are reported apart); the
   timed loop starts after a few warm-up steps and only trains (:mod:`herald.bench.common`).
2. ``herald train`` (:func:`herald.job.launcher.run_train`, progress off, its own run dir
   in a temporary folder) with 1, 2, 4, ... up to ``--max-workers`` workers for each
   schedule in ``--schedules``, ``--batch-size`` samples per worker, eval fraction
   0.02. Samples/s is the report's ``samples_per_second``: steady throughput, from the
   first step's ack to the last (start-up and the first step are out, as the baseline's
   warm-up is); the report's ``wall_samples_per_second`` (start-up in) is kept beside it,
   and the PS shards' step barrier (``step_barrier``: how far apart a step's messages came
   and the release, NOTE [step barrier timing] in herald/ps/stepped.py).
3. the dispatcher's capacity (:func:`herald.bench.capacity.measure_capacity`: a real
   dispatcher, herald schedule, 8 workers x 256 replaced by peers that ack at once, on
   its own synthetic Criteo rows, ``--capacity-seconds`` long): the ceiling of any job;
   ``null`` with ``--no-capacity``.

4. **TorchRec** (unless ``--no-torchrec``; :mod:`herald.bench.torchrec_baseline`): the same
   model, init, optimizers, rows and batches as 1., written as ``torchrec.models.dlrm.DLRM``
   over a ``FusedEmbeddingBagCollection`` (FBGEMM table-batched embeddings, Adagrad fused
   into backward), 1 process, 1 thread; on CUDA too where FBGEMM's CUDA build is installed.
   Without torchrec the JSON says ``{"error": "torchrec not installed: make torchrec"}``.

5. **TorchRec at N workers** (unless ``--no-torchrec``; :mod:`herald.bench.torchrec_dist`):
   for each N of 2., N gloo processes training the same model on the same rows at
   ``--batch-size`` per process, under ``DistributedModelParallel`` (or, where TorchRec
   cannot shard on the CPU, its ``EmbeddingBagCollection`` under DDP, the failing call
   named): ``torchrec_runs``, one entry per N with ``workers``, ``samples_per_s``,
   ``cpu_us_per_sample``, ``mode``; each herald run gets ``ratio_vs_torchrec_same_workers``.

6. on a machine with CUDA (unless ``--no-gpu``), the GPU section
   (:mod:`herald.bench.gpu`): plain PyTorch on the GPU against herald with 1 worker
   on the GPU (the device-resident cache) and on the CPU, at batch 256 and 4,096.

Every herald run of 2. trains on the CPU (``--device cpu``), as the baseline does.
The table gives, per run, samples/s, the ratios to plain PyTorch and to TorchRec, the scaling factor
``T_N / (N * T_1)`` of its schedule (Herald §6.3, after [51]: ``T_1`` is that schedule's
1-worker throughput) and the worker phases taking most of a step (the report's
``phases``, ms per step). ``--repeats R`` runs everything R times and reports medians; each
repeat runs plain PyTorch and then every herald job, so a herald run's ratios to plain
PyTorch (samples/s, ``ratio_vs_plain_torch``; job CPU per sample,
``cpu_ratio_vs_plain_torch``; the job's CPU per sample in steady training,
``steady_cpu_ratio_vs_plain_torch``) are the medians of its repeats' ratios to the plain
run of the same repeat: a noisy minute hits both sides of a ratio. The job's CPU counts
every process's start-up, the held-out evaluation and the report; its steady figure
(NOTE [steady cpu] in herald/job/runner.py) only the training from the first step on,
as the baseline's counts its training loop.

Runtime per repeat on 2 cores: ``--rows 300000 --max-workers 2`` took 3.3 minutes (each
herald job also spends 7-25 s starting up and evaluating); the default ``--rows 1200000``
needs about 4x the training time, roughly 11 minutes (scaled, not measured). The
baseline holds the training split and its tables in memory (under 1 GB at 1.2M rows,
estimated). Run as ``herald bench scale``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile

import torch

from herald.bench import gpu, torchrec_dist
from herald.bench.capacity import measure_capacity
from herald.bench.common import (
    WARMUP_STEPS,
    PlainBatches,
    load_plain_batches,
    median_phases,
    run_herald,
    top_phases,
    train_plain_torch,
)
from herald.bench.options import add_scale_arguments, cores
from herald.bench.table import print_head
from herald.bench.torchrec_baseline import describe, format_ratio, ratio_to, torchrec_baseline
from herald.contracts.vocab import SCHEDULES
from herald.errors import ConfigError

CAPACITY_WORKERS, CAPACITY_BATCH_SIZE, CAPACITY_SCHEDULE = 8, 256, "herald"


def worker_counts(max_workers: int) -> list[int]:
    """``[1, 2, 4, ..., max_workers]`` (powers of two, then ``max_workers`` itself)."""
    counts = [1 << i for i in range(max_workers.bit_length()) if 1 << i <= max_workers]
    return counts if counts[-1] == max_workers else counts + [max_workers]


def dispatcher_capacity(seconds: float = 5.0) -> float:
    """Samples/s the dispatcher alone sustains over ``seconds`` s
    (:func:`herald.bench.capacity.measure_capacity`: fake workers that ack at once,
    8 workers x 256, herald schedule)."""
    got = measure_capacity(
        workers=CAPACITY_WORKERS, batch_size=CAPACITY_BATCH_SIZE, schedule=CAPACITY_SCHEDULE, seconds=seconds
    )
    print(f"dispatcher capacity: {got['samples_per_s']:,.0f} samples/s", flush=True)
    return float(got["samples_per_s"])


# ------------------------------------------------------------------ the run


def _validate(args: argparse.Namespace) -> None:
    for name in ("rows", "max_workers", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.torchrec_workers or [1]) < 1:
        raise ConfigError(f"--torchrec-workers must be >= 1, got {args.torchrec_workers}")
    if min(args.gpu_batch_sizes, default=1) < 1:
        raise ConfigError(f"--gpu-batch-sizes must be >= 1, got {args.gpu_batch_sizes}")
    if args.capacity_seconds <= 0:
        raise ConfigError(f"--capacity-seconds must be > 0, got {args.capacity_seconds}")
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        raise ConfigError(f"unknown schedules {unknown}; choose from {sorted(SCHEDULES)}")
    if args.out:  # its folder now, not after minutes of measuring
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)


def _plain_data(source: str, args: argparse.Namespace) -> PlainBatches:
    """The plain baseline's batches, read and remapped once for every repeat."""
    data = load_plain_batches(source, args.batch_size)
    print(
        f"plain PyTorch: {len(data.batches)} batches of {args.batch_size} read in {data.read_s:.1f} s, ids "
        f"remapped in {data.remap_s:.1f} s ({sum(data.table_rows):,} embedding rows)",
        flush=True,
    )
    return data


def _plain(data: PlainBatches, got: list[dict]) -> dict:
    """The plain baseline's result from its repeats ``got`` (:func:`train_plain_torch`)."""
    return {
        "samples_per_s": statistics.median(p["samples_per_s"] for p in got),
        "repeats_samples_per_s": [p["samples_per_s"] for p in got],
        "cpu_us_per_sample": statistics.median(p["cpu_us_per_sample"] for p in got),
        "repeats_cpu_us_per_sample": [p["cpu_us_per_sample"] for p in got],
        "timed_steps": got[0]["timed_steps"],
        "read_s": data.read_s,
        "remap_s": data.remap_s,
        "embedding_rows": sum(data.table_rows),
    }


def _runs(source: str, args: argparse.Namespace, data: PlainBatches, trec: dict | None) -> tuple[dict, list[dict]]:
    """Each repeat: plain PyTorch, then every herald run, so that a ratio compares runs of
    the same minutes on a noisy machine; ``(plain, herald runs)``. A run's
    ``ratio_vs_plain_torch`` and ``cpu_ratio_vs_plain_torch`` are the medians of its
    repeats' ratios to the plain run of the same repeat."""
    runs = [(w, s) for w in worker_counts(args.max_workers) for s in args.schedules]
    got: dict[tuple[int, str], list[dict]] = {r: [] for r in runs}
    plain_reps = []
    with tempfile.TemporaryDirectory(prefix="herald-bench-scale-") as tmp:
        for rep in range(args.repeats):
            plain_reps.append(train_plain_torch(data, seed=args.seed))
            print(f"plain PyTorch: {plain_reps[-1]['samples_per_s']:,.0f} samples/s", flush=True)
            for workers, schedule in runs:
                r = run_herald(
                    source,
                    workers,
                    schedule,
                    args.batch_size,
                    str(pathlib.Path(tmp) / f"{schedule}-w{workers}-r{rep}"),
                    args.seed,
                    pin_cores=args.pin_cores,
                )
                got[(workers, schedule)].append(r)
                print(f"herald {schedule}, {workers} workers: {r['samples_per_s']:,.0f} samples/s", flush=True)
    plain = _plain(data, plain_reps)
    out = []
    for (workers, schedule), reps in got.items():
        sps = statistics.median(r["samples_per_s"] for r in reps)
        out.append(
            {
                "workers": workers,
                "schedule": schedule,
                "samples_per_s": sps,
                "phases_ms": median_phases([r["phases_ms"] for r in reps]),
                "wall_ms_per_step": statistics.median(r["wall_ms_per_step"] for r in reps),
                "cpu_us_per_sample": statistics.median(r["cpu_us_per_sample"] for r in reps),
                "ratio_vs_plain_torch": statistics.median(
                    r["samples_per_s"] / p["samples_per_s"] for r, p in zip(reps, plain_reps)
                ),
                "cpu_ratio_vs_plain_torch": statistics.median(
                    r["cpu_us_per_sample"] / p["cpu_us_per_sample"] for r, p in zip(reps, plain_reps)
                ),
                "steady_cpu_us_per_sample": statistics.median(r["steady_cpu_us_per_sample"] for r in reps),
                "steady_cpu_ratio_vs_plain_torch": statistics.median(
                    r["steady_cpu_us_per_sample"] / p["cpu_us_per_sample"] for r, p in zip(reps, plain_reps)
                ),
                "ratio_vs_torchrec": ratio_to(trec, sps),
                "wall_samples_per_s": statistics.median(r["wall_samples_per_s"] or 0.0 for r in reps),
                "startup_s": statistics.median(r["startup_s"] or 0.0 for r in reps),
                "repeats_samples_per_s": [r["samples_per_s"] for r in reps],
                "repeats_cpu_us_per_sample": [r["cpu_us_per_sample"] for r in reps],
                "repeats_steady_cpu_us_per_sample": [r["steady_cpu_us_per_sample"] for r in reps],
                "step_barrier": barrier_summary([r["step_barrier"] for r in reps]),
                "arrivals": [b.get("arrivals") for b in reps[-1]["step_barrier"]],  # NOTE [step arrivals]
            }
        )
    for r in out:
        t1 = next(o["samples_per_s"] for o in out if o["schedule"] == r["schedule"] and o["workers"] == 1)
        r["scaling_factor"] = r["samples_per_s"] / (r["workers"] * t1)
    return plain, out


def barrier_summary(per_repeat: list[list[dict]]) -> dict | None:
    """``{"spread_ms", "release_ms"}``: the shards' mean spread of a step's messages and mean
    release (NOTE [step barrier timing] in herald/ps/stepped.py), averaged over the shards,
    median over the repeats; None when no repeat had step messages."""
    got = [
        (statistics.mean(b["spread_ms_mean"] for b in shards), statistics.mean(b["release_ms_mean"] for b in shards))
        for shards in per_repeat
        if shards
    ]
    if not got:
        return None
    return {
        "spread_ms": round(statistics.median(g[0] for g in got), 3),
        "release_ms": round(statistics.median(g[1] for g in got), 3),
    }


def torchrec_at_each(data: PlainBatches, args: argparse.Namespace) -> list[dict]:
    """TorchRec at each N of the herald runs (:func:`herald.bench.torchrec_dist.torchrec_runs`),
    pinned one rank per core with ``--pin-cores``; the warm-up shortened to half a rank's
    steps where the rows leave fewer than twice :data:`WARMUP_STEPS` at the largest N."""
    counts = args.torchrec_workers or worker_counts(args.max_workers)
    warmup = max(1, min(WARMUP_STEPS, len(data.batches) // counts[-1] // 2))
    pin = sorted(os.sched_getaffinity(0)) if args.pin_cores and hasattr(os, "sched_getaffinity") else None
    return torchrec_dist.torchrec_runs(data, counts, seed=args.seed, warmup_steps=warmup, pin_cores=pin)


def _same_workers_ratio(trec_runs: list[dict] | None, run: dict) -> float | None:
    """A herald run's samples/s over TorchRec's at the same N, or None without that figure."""
    got = [t for t in trec_runs or [] if t.get("workers") == run["workers"] and t.get("samples_per_s")]
    return run["samples_per_s"] / got[0]["samples_per_s"] if got else None


def run(args: argparse.Namespace) -> dict:
    """Everything above; prints the table and returns (and with ``--out`` writes) the results.

    Raises:
        ConfigError: a bad option; HeraldError: a herald job failed.
    """
    _validate(args)
    source = args.source or f"synthetic://criteo?rows={args.rows}&seed=1"
    data = _plain_data(source, args)
    trec = (
        None if args.no_torchrec else torchrec_baseline(data, repeats=args.repeats, seed=args.seed, gpu=not args.no_gpu)
    )
    plain, runs = _runs(source, args, data, trec)
    trec_runs = None if args.no_torchrec else torchrec_at_each(data, args)
    for r in runs:
        r["ratio_vs_torchrec_same_workers"] = _same_workers_ratio(trec_runs, r)
    capacity = None if args.no_capacity else dispatcher_capacity(args.capacity_seconds)
    gpu_rows = None
    if torch.cuda.is_available() and not args.no_gpu:
        with tempfile.TemporaryDirectory(prefix="herald-bench-gpu-") as tmp:
            gpu_rows = gpu.gpu_section(source, args, tmp)
    results = {
        "plain_torch": plain,
        "torchrec": trec,
        "runs": runs,
        "torchrec_runs": trec_runs,
        "dispatcher_capacity_samples_per_s": capacity,
        "gpu": gpu_rows,
        "cores": cores(),
        "source": source,
        "rows": args.rows,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
    }
    print_table(results)
    if gpu_rows is not None:
        gpu.print_gpu_table(gpu_rows, torch.cuda.get_device_name())
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"\nwritten {args.out}")
    return results


def print_table(results: dict) -> None:
    """The comparison as a Markdown table (one row per run, plain PyTorch and TorchRec first)."""
    plain, trec = results["plain_torch"], results.get("torchrec")
    print(
        f"\n{results['cores']} cores, batch {results['batch_size']} per worker, median of "
        f"{results['repeats']} run(s); plain PyTorch: 1 process, 1 thread, batches pre-read; a herald step "
        "is workers x batch samples; the ratios to plain PyTorch are medians of each repeat's ratio to the "
        "plain run of the same repeat\n"
    )
    print_head(
        "workers | schedule | samples/s | vs plain PyTorch | vs TorchRec | scaling T_N/(N*T_1) | wall ms/step "
        "| job CPU us/sample (steady) | top worker phases (ms/step)",
        lead="",
    )
    ms = 1e3 * results["batch_size"] / plain["samples_per_s"]
    trec_ratio = format_ratio(plain["samples_per_s"] / trec["samples_per_s"] if trec and "error" not in trec else None)
    print(
        f"| 1 | plain PyTorch | {plain['samples_per_s']:,.0f} | 1.00x | {trec_ratio} | - | {ms:.2f} | "
        f"{plain['cpu_us_per_sample']:.1f} | - |"
    )
    if trec and "error" not in trec:
        ms = 1e3 * results["batch_size"] / trec["samples_per_s"]
        print(
            f"| 1 | TorchRec (fused TBE) | {trec['samples_per_s']:,.0f} | "
            f"{trec['samples_per_s'] / plain['samples_per_s']:.2f}x | 1.00x | - | {ms:.2f} | - | - |"
        )
    else:
        print(f"| 1 | TorchRec | {describe(trec)} | - | - | - | - | - | - |")
    for r in results["runs"]:
        print(
            f"| {r['workers']} | {r['schedule']} | {r['samples_per_s']:,.0f} | {r['ratio_vs_plain_torch']:.2f}x | "
            f"{format_ratio(r.get('ratio_vs_torchrec'))} | {r['scaling_factor']:.2f} | {r['wall_ms_per_step']:.2f} "
            f"| {r['cpu_us_per_sample']:.1f} ({r['cpu_ratio_vs_plain_torch']:.2f}x); steady "
            f"{r['steady_cpu_us_per_sample']:.1f} ({r['steady_cpu_ratio_vs_plain_torch']:.2f}x) "
            f"| {top_phases(r['phases_ms'])} |"
        )
    barriers = [r for r in results["runs"] if r.get("step_barrier")]
    if barriers:
        print(
            "\nstep barrier at the PS (NOTE [step barrier timing]: a step's messages first to last, then the "
            "release; mean over the shards, median of the repeats):"
        )
        for r in barriers:
            b = r["step_barrier"]
            print(
                f"  {r['workers']} workers, {r['schedule']}: {b['spread_ms']:.2f} ms apart, release "
                f"{b['release_ms']:.2f} ms; the workers' step_wait {r['phases_ms'].get('step_wait', 0.0):.2f} ms"
            )
    print(f"\n{describe(trec)}")
    print_torchrec_runs(results.get("torchrec_runs"), results["runs"])
    cap = results["dispatcher_capacity_samples_per_s"]
    print(
        f"\ndispatcher capacity ({CAPACITY_WORKERS} workers x {CAPACITY_BATCH_SIZE}, {CAPACITY_SCHEDULE}): "
        + (
            f"{cap:,.0f} samples/s, {cap / max(r['samples_per_s'] for r in results['runs']):.1f}x the fastest "
            "herald run"
            if cap is not None
            else "not measured"
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="herald bench scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_scale_arguments(p)
    run(p.parse_args(argv))
    return 0


def print_torchrec_runs(trec_runs: list[dict] | None, runs: list[dict]) -> None:
    """TorchRec at N workers beside herald's best run at the same N."""
    if trec_runs is None:
        print("\nTorchRec at N workers: not run (--no-torchrec)")
        return
    print("\nTorchRec at N workers (gloo, 1 thread per process; herald: its fastest schedule at that N)\n")
    print_head("workers | TorchRec mode | samples/s | CPU us/sample | herald samples/s | herald vs TorchRec", lead="")
    for t in trec_runs:
        if "error" in t:
            print(f"| {t.get('workers', '-')} | {t['error']} | - | - | - | - |")
            continue
        best = max((r for r in runs if r["workers"] == t["workers"]), key=lambda r: r["samples_per_s"], default=None)
        mode = t["mode"] + (f" (DMP failed: {t['dmp_error']})" if t.get("dmp_error") else "")
        print(
            f"| {t['workers']} | {mode} | {t['samples_per_s']:,.0f} | {t['cpu_us_per_sample']:.1f} | "
            + (
                f"{best['samples_per_s']:,.0f} | {best['samples_per_s'] / t['samples_per_s']:.2f}x |"
                if best
                else "- | - |"
            )
        )
