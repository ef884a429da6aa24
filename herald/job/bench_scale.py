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
   timed loop starts after a few warm-up steps and only trains.
2. ``herald train`` (:func:`herald.job.launcher.run_train`, progress off, its own run dir
   in a temporary folder) with 1, 2, 4, ... up to ``--max-workers`` workers for each
   schedule in ``--schedules``, ``--batch-size`` samples per worker, eval fraction
   0.02. Samples/s is the report's ``samples_per_second``: steady throughput, from the
   first step's ack to the last (start-up and the first step are out, as the baseline's
   warm-up is); the report's ``wall_samples_per_second`` (start-up in) is kept beside it.
3. the dispatcher's capacity (:func:`herald.dispatch.capacity.measure_capacity`: a real
   dispatcher, herald schedule, 8 workers x 256 replaced by peers that ack at once, on
   its own synthetic Criteo rows, ``--capacity-seconds`` long): the ceiling of any job;
   ``null`` when that module is not in the tree.

4. **TorchRec** (unless ``--no-torchrec``; :mod:`herald.job.bench_torchrec`): the same
   model, init, optimizers, rows and batches as 1., written as ``torchrec.models.dlrm.DLRM``
   over a ``FusedEmbeddingBagCollection`` (FBGEMM table-batched embeddings, Adagrad fused
   into backward), 1 process, 1 thread; on CUDA too where FBGEMM's CUDA build is installed.
   Without torchrec the JSON says ``{"error": "torchrec not installed: make torchrec"}``.

5. on a machine with CUDA (unless ``--no-gpu``), the GPU section
   (:mod:`herald.job.bench_gpu`): plain PyTorch on the GPU against herald with 1 worker
   on the GPU (the device-resident cache) and on the CPU, at batch 256 and 4,096.

Every herald run of 2. trains on the CPU (``--device cpu``), as the baseline does.
The table gives, per run, samples/s, the ratios to plain PyTorch and to TorchRec, the scaling factor
``T_N / (N * T_1)`` of its schedule (Herald §6.3, after [51]: ``T_1`` is that schedule's
1-worker throughput) and the worker phases taking most of a step (the report's
``phases``, ms per step). ``--repeats R`` runs everything R times and reports medians.

Runtime per repeat on 2 cores: ``--rows 300000 --max-workers 2`` took 3.3 minutes (each
herald job also spends 7-25 s starting up and evaluating); the default ``--rows 1200000``
needs about 4x the training time, roughly 11 minutes (scaled, not measured). The
baseline holds the training split and its tables in memory (under 1 GB at 1.2M rows,
estimated). Run as ``herald bench scale`` or ``python bench/bench_scale.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from herald.errors import ConfigError
from herald.job.bench_gpu import GPU_BATCH_SIZES

EVAL_FRACTION = 0.02
WARMUP_STEPS = 10
TOP_PHASES = 3
CAPACITY_WORKERS, CAPACITY_BATCH_SIZE, CAPACITY_SCHEDULE = 8, 256, "herald"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default=None, help="default: synthetic://criteo?rows=ROWS&seed=1")
    p.add_argument("--rows", type=int, default=1_200_000,
                   help="rows of the synthetic stream, enough to warm the caches (default: %(default)s)")
    p.add_argument("--max-workers", type=int, default=max(2, _cores()),
                   help="herald runs with 1, 2, 4, ... workers up to this (default: the cores, at least 2: "
                        "%(default)s)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="samples per step of plain PyTorch and per worker per step of herald (default: %(default)s)")
    p.add_argument("--schedules", nargs="+", default=["vanilla", "herald"], help="(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="run everything R times, report medians (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="model seed of every run (default: %(default)s)")
    p.add_argument("--capacity-seconds", type=float, default=5.0,
                   help="how long the dispatcher capacity is measured (default: %(default)s)")
    p.add_argument("--no-capacity", action="store_true", help="skip the dispatcher capacity measurement")
    p.add_argument("--gpu-batch-sizes", type=int, nargs="+", default=list(GPU_BATCH_SIZES), metavar="B",
                   help="batch sizes of the GPU section, run when CUDA is available (default: %(default)s)")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU section (and TorchRec on CUDA)")
    p.add_argument("--no-torchrec", action="store_true", help="leave the TorchRec baseline out")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")


def worker_counts(max_workers: int) -> list[int]:
    """``[1, 2, 4, ..., max_workers]`` (powers of two, then ``max_workers`` itself)."""
    counts = [1 << i for i in range(max_workers.bit_length()) if 1 << i <= max_workers]
    return counts if counts[-1] == max_workers else counts + [max_workers]


# ------------------------------------------------------------------ plain PyTorch


@dataclasses.dataclass
class PlainBatches:
    """The training split in memory, ids remapped per table to ``0 .. table_rows[t]-1``.

    ``batches``: ``(dense float32 [B, D], labels float32 [B], ids int64 [nnz_t] per table,
    offsets int64 [B] per table)``; ``read_s`` / ``remap_s``: seconds spent reading the
    rows through herald's loader and remapping the ids.
    """

    batches: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]
    table_rows: list[int]
    dense_dim: int
    read_s: float
    remap_s: float


def load_plain_batches(source: str, batch_size: int, *, eval_fraction: float = EVAL_FRACTION,
                       max_steps: int | None = None) -> PlainBatches:
    """Read the training split of ``source`` (the rows ``herald train`` trains on with
    ``eval_fraction``) as batches of ``batch_size`` (the partial last one dropped, as
    herald does) and remap each table's ids with ``np.unique``.

    Raises:
        ConfigError: fewer training rows than one batch.
    """
    from herald.loader import splits
    from herald.loader.global_batches import GlobalBatches

    t0 = time.perf_counter()
    train, ev, _ = splits.open_train_eval(source, eval_fraction, {})
    if ev is not None:
        ev.close()
    with GlobalBatches(train, batch_size, max_steps=max_steps) as batches:
        raw = list(batches)
    if not raw:
        raise ConfigError(f"{source}: no full batch of {batch_size} rows to train on; lower --batch-size")
    t1 = time.perf_counter()
    per_table, table_rows = [], []
    for t in range(raw[0].num_tables):
        uniq, inv = np.unique(np.concatenate([b.values[t] for b in raw]), return_inverse=True)
        cuts = np.cumsum([b.values[t].shape[0] for b in raw])[:-1]
        per_table.append([torch.from_numpy(np.ascontiguousarray(part)) for part in np.split(inv.astype(np.int64), cuts)])
        table_rows.append(max(1, int(uniq.shape[0])))
    out = [(torch.from_numpy(b.dense), torch.from_numpy(b.labels), [ids[i] for ids in per_table],
            [torch.from_numpy(np.ascontiguousarray(o[:-1])) for o in b.offsets]) for i, b in enumerate(raw)]
    return PlainBatches(out, table_rows, raw[0].dense.shape[1], read_s=t1 - t0, remap_s=time.perf_counter() - t1)


class PlainDLRM(nn.Module):
    """herald's DLRM (dense part, seeded as herald seeds it) over ``nn.EmbeddingBag`` s
    (sum, sparse gradients, uniform(-0.05, 0.05) as herald's PS initialises rows).

    Forward: ``dense [B, D]``, ids and offsets per table -> logits ``[B]``.
    """

    def __init__(self, dense_dim: int, table_rows: list[int], embedding_dim: int, seed: int):
        super().__init__()
        from herald.spec.tables import TableConfig
        from herald.worker.models import build_model

        self.dense = build_model("dlrm", dense_dim, len(table_rows), embedding_dim, seed=seed)
        scale = TableConfig(name="t", dim=embedding_dim).init_scale
        gen = torch.Generator().manual_seed(seed)
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, embedding_dim, mode="sum", sparse=True) for n in table_rows)
        with torch.no_grad():
            for bag in self.bags:
                bag.weight.uniform_(-scale, scale, generator=gen)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        emb = torch.stack([bag(i, o) for bag, i, o in zip(self.bags, ids, offsets)], dim=1)
        return self.dense(dense, emb)


def _train_loop(model: PlainDLRM, data: PlainBatches, warmup_steps: int) -> tuple[list[float], float]:
    """Every step's loss, and the seconds of the steps after the first ``warmup_steps``."""
    from herald.spec.train import TrainConfig
    from herald.spec.tables import OptimizerConfig

    defaults = TrainConfig()
    sparse_opt = torch.optim.Adagrad(model.bags.parameters(), lr=defaults.lr, eps=OptimizerConfig("adagrad").eps)
    dense_opt = torch.optim.Adam(model.dense.parameters(), lr=defaults.dense_lr)
    losses, t0 = [], time.perf_counter()
    for step, (dense, labels, ids, offsets) in enumerate(data.batches):
        if step == warmup_steps:
            t0 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def train_plain_torch(data: PlainBatches, *, embedding_dim: int = 16, seed: int = 0,
                      warmup_steps: int = WARMUP_STEPS) -> dict:
    """Train a fresh :class:`PlainDLRM` once over ``data`` with 1 torch thread (restored
    after); the clock starts after ``warmup_steps`` steps.

    Returns:
        ``{"samples_per_s", "timed_steps", "train_s", "losses"}`` (``losses``: every step's).

    Raises:
        ConfigError: no step left to time after the warm-up.
    """
    if len(data.batches) <= warmup_steps:
        raise ConfigError(f"{len(data.batches)} batches leave nothing to time after {warmup_steps} warm-up "
                          "steps; raise --rows or lower --batch-size")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # the sparse gradients come from EmbeddingBag itself: no invariant checks (torch's
        # default, said explicitly, which also silences its warning)
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            model = PlainDLRM(data.dense_dim, data.table_rows, embedding_dim, seed)
            losses, train_s = _train_loop(model, data, warmup_steps)
    finally:
        torch.set_num_threads(threads)
    rows = sum(int(b[1].shape[0]) for b in data.batches[warmup_steps:])
    return {"samples_per_s": rows / train_s, "timed_steps": len(data.batches) - warmup_steps, "train_s": train_s,
            "losses": losses}


def plain_torch_losses(source: str, steps: int, *, batch_size: int = 256, seed: int = 0) -> list[float]:
    """The plain-PyTorch baseline's loss at each of its first ``steps`` steps on ``source``
    (to check that the baseline really trains)."""
    data = load_plain_batches(source, batch_size, max_steps=steps)
    return train_plain_torch(data, seed=seed, warmup_steps=0)["losses"]


# ------------------------------------------------------------------ herald


def run_herald(source: str, workers: int, schedule: str, batch_size: int, run_dir: str, seed: int = 0,
               device: str = "cpu") -> dict:
    """One ``herald train`` job on ``device`` (``--device``); ``{"samples_per_s", "phases_ms",
    "wall_ms_per_step", "steps"}`` (``phases_ms``: the worker's median ms per phase, ``{}``
    when the report has no ``phases``)."""
    from herald.job.launcher import run_train
    from herald.spec.train import TrainConfig

    cfg = TrainConfig(source=source, schedule=schedule, workers=workers, batch_size=batch_size,
                      eval_fraction=EVAL_FRACTION, seed=seed, run_dir=run_dir, device=device)
    with contextlib.redirect_stdout(io.StringIO()):  # the report text: the table says what matters here
        rep = run_train(cfg, progress=False)
    phases = rep.get("phases") or {}
    return {"samples_per_s": rep["samples_per_second"], "phases_ms": dict(phases.get("worker_ms_per_step", {})),
            "wall_ms_per_step": phases.get("wall_ms_per_step", rep["train_seconds"] * 1e3 / max(1, rep["steps"])),
            "wall_samples_per_s": rep.get("wall_samples_per_second"), "startup_s": rep.get("startup_seconds"),
            "steps": rep["steps"]}


def dispatcher_capacity(seconds: float = 5.0) -> float | None:
    """Samples/s the dispatcher alone sustains over ``seconds`` s
    (:func:`herald.dispatch.capacity.measure_capacity`: fake workers that ack at once,
    8 workers x 256, herald schedule), or None when that module is not in this tree."""
    try:
        from herald.dispatch.capacity import measure_capacity
    except ModuleNotFoundError as exc:
        if exc.name != "herald.dispatch.capacity":
            raise
        print("dispatcher capacity: not measured (herald.dispatch.capacity is not in this tree)")
        return None
    got = measure_capacity(workers=CAPACITY_WORKERS, batch_size=CAPACITY_BATCH_SIZE, schedule=CAPACITY_SCHEDULE,
                           seconds=seconds)
    print(f"dispatcher capacity: {got['samples_per_s']:,.0f} samples/s", flush=True)
    return float(got["samples_per_s"])


# ------------------------------------------------------------------ the run


def _median_phases(phases: list[dict]) -> dict[str, float]:
    names = list(dict.fromkeys(k for p in phases for k in p))
    return {k: round(statistics.median(p.get(k, 0.0) for p in phases), 3) for k in names}


def _validate(args: argparse.Namespace) -> None:
    from herald.spec.vocab import SCHEDULES

    for name in ("rows", "max_workers", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.gpu_batch_sizes, default=1) < 1:
        raise ConfigError(f"--gpu-batch-sizes must be >= 1, got {args.gpu_batch_sizes}")
    if args.capacity_seconds <= 0:
        raise ConfigError(f"--capacity-seconds must be > 0, got {args.capacity_seconds}")
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        raise ConfigError(f"unknown schedules {unknown}; choose from {sorted(SCHEDULES)}")
    if args.out:   # its folder now, not after minutes of measuring
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)


def _baselines(source: str, args: argparse.Namespace) -> tuple[dict, dict | None]:
    """Plain PyTorch and (unless ``--no-torchrec``) TorchRec on the same batches."""
    from herald.job.bench_torchrec import torchrec_baseline

    data = load_plain_batches(source, args.batch_size)
    plain = _plain(data, args)
    trec = None if args.no_torchrec else torchrec_baseline(data, repeats=args.repeats, seed=args.seed,
                                                           gpu=not args.no_gpu)
    return plain, trec


def _plain(data: PlainBatches, args: argparse.Namespace) -> dict:
    print(f"plain PyTorch: {len(data.batches)} batches of {args.batch_size} read in {data.read_s:.1f} s, ids "
          f"remapped in {data.remap_s:.1f} s ({sum(data.table_rows):,} embedding rows)", flush=True)
    got = [train_plain_torch(data, seed=args.seed) for _ in range(args.repeats)]
    sps = statistics.median(p["samples_per_s"] for p in got)
    print(f"plain PyTorch: {sps:,.0f} samples/s", flush=True)
    return {"samples_per_s": sps, "repeats_samples_per_s": [p["samples_per_s"] for p in got],
            "timed_steps": got[0]["timed_steps"], "read_s": data.read_s, "remap_s": data.remap_s,
            "embedding_rows": sum(data.table_rows)}


def _herald_runs(source: str, args: argparse.Namespace, plain_sps: float, trec: dict | None) -> list[dict]:
    from herald.job.bench_torchrec import ratio_to

    runs = [(w, s) for w in worker_counts(args.max_workers) for s in args.schedules]
    got: dict[tuple[int, str], list[dict]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory(prefix="herald-bench-scale-") as tmp:
        for rep in range(args.repeats):  # repeats interleaved: a noisy minute hits every run alike
            for workers, schedule in runs:
                r = run_herald(source, workers, schedule, args.batch_size,
                               str(pathlib.Path(tmp) / f"{schedule}-w{workers}-r{rep}"), args.seed)
                got[(workers, schedule)].append(r)
                print(f"herald {schedule}, {workers} workers: {r['samples_per_s']:,.0f} samples/s", flush=True)
    out = []
    for (workers, schedule), reps in got.items():
        sps = statistics.median(r["samples_per_s"] for r in reps)
        out.append({"workers": workers, "schedule": schedule, "samples_per_s": sps,
                    "phases_ms": _median_phases([r["phases_ms"] for r in reps]),
                    "wall_ms_per_step": statistics.median(r["wall_ms_per_step"] for r in reps),
                    "ratio_vs_plain_torch": sps / plain_sps, "ratio_vs_torchrec": ratio_to(trec, sps),
                    "wall_samples_per_s": statistics.median(r["wall_samples_per_s"] or 0.0 for r in reps),
                    "startup_s": statistics.median(r["startup_s"] or 0.0 for r in reps),
                    "repeats_samples_per_s": [r["samples_per_s"] for r in reps]})
    for r in out:
        t1 = next(o["samples_per_s"] for o in out if o["schedule"] == r["schedule"] and o["workers"] == 1)
        r["scaling_factor"] = r["samples_per_s"] / (r["workers"] * t1)
    return out


def run(args: argparse.Namespace) -> dict:
    """Everything above; prints the table and returns (and with ``--out`` writes) the results.

    Raises:
        ConfigError: a bad option; HeraldError: a herald job failed.
    """
    _validate(args)
    source = args.source or f"synthetic://criteo?rows={args.rows}&seed=1"
    plain, trec = _baselines(source, args)
    runs = _herald_runs(source, args, plain["samples_per_s"], trec)
    capacity = None if args.no_capacity else dispatcher_capacity(args.capacity_seconds)
    gpu = None
    if torch.cuda.is_available() and not args.no_gpu:
        from herald.job import bench_gpu

        with tempfile.TemporaryDirectory(prefix="herald-bench-gpu-") as tmp:
            gpu = bench_gpu.gpu_section(source, args, tmp)
    results = {"plain_torch": plain, "torchrec": trec, "runs": runs, "dispatcher_capacity_samples_per_s": capacity,
               "gpu": gpu, "cores": _cores(), "source": source, "rows": args.rows, "batch_size": args.batch_size,
               "repeats": args.repeats}
    print_table(results)
    if gpu is not None:
        from herald.job import bench_gpu

        bench_gpu.print_gpu_table(gpu, torch.cuda.get_device_name())
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"\nwritten {args.out}")
    return results


def _top_phases(phases: dict[str, float]) -> str:
    top = sorted(phases.items(), key=lambda kv: -kv[1])[:TOP_PHASES]
    return ", ".join(f"{k} {v:.2f}" for k, v in top) if top else "(no breakdown in the report)"


def print_table(results: dict) -> None:
    """The comparison as a Markdown table (one row per run, plain PyTorch and TorchRec first)."""
    from herald.job.bench_torchrec import describe, format_ratio

    plain, trec = results["plain_torch"], results.get("torchrec")
    print(f"\n{results['cores']} cores, batch {results['batch_size']} per worker, median of "
          f"{results['repeats']} run(s); plain PyTorch: 1 process, 1 thread, batches pre-read; a herald step "
          "is workers x batch samples\n")
    print("| workers | schedule | samples/s | vs plain PyTorch | vs TorchRec | scaling T_N/(N*T_1) | wall ms/step "
          "| top worker phases (ms/step) |")
    print("|---|---|---|---|---|---|---|---|")
    ms = 1e3 * results["batch_size"] / plain["samples_per_s"]
    trec_ratio = format_ratio(plain["samples_per_s"] / trec["samples_per_s"] if trec and "error" not in trec else None)
    print(f"| 1 | plain PyTorch | {plain['samples_per_s']:,.0f} | 1.00x | {trec_ratio} | - | {ms:.2f} | - |")
    if trec and "error" not in trec:
        ms = 1e3 * results["batch_size"] / trec["samples_per_s"]
        print(f"| 1 | TorchRec (fused TBE) | {trec['samples_per_s']:,.0f} | "
              f"{trec['samples_per_s'] / plain['samples_per_s']:.2f}x | 1.00x | - | {ms:.2f} | - |")
    else:
        print(f"| 1 | TorchRec | {describe(trec)} | - | - | - | - | - |")
    for r in results["runs"]:
        print(f"| {r['workers']} | {r['schedule']} | {r['samples_per_s']:,.0f} | {r['ratio_vs_plain_torch']:.2f}x | "
              f"{format_ratio(r.get('ratio_vs_torchrec'))} | {r['scaling_factor']:.2f} | {r['wall_ms_per_step']:.2f} "
              f"| {_top_phases(r['phases_ms'])} |")
    print(f"\n{describe(trec)}")
    cap = results["dispatcher_capacity_samples_per_s"]
    print(f"\ndispatcher capacity ({CAPACITY_WORKERS} workers x {CAPACITY_BATCH_SIZE}, {CAPACITY_SCHEDULE}): "
          + (f"{cap:,.0f} samples/s, {cap / max(r['samples_per_s'] for r in results['runs']):.1f}x the fastest "
             "herald run" if cap is not None else "not measured"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="herald bench scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0
