"""``herald bench scheduler``: Herald's Table 2 on real or synthetic data, timing, scaling,
brute-force quality and snapshot memory. Everything is measured in the same run.

Protocol and counters: docs/design.md, "Consistency protocol", and docs/scheduler.md,
"Exact semantics"; reductions are relative to ``vanilla`` (random partition + full-set
sync) measured on the same batches. ``--threads``: :mod:`herald.bench.scheduler_threads`;
``--compare-ref REF`` and ``--pool-vs-prange`` (instead of the table):
:mod:`herald.bench.scheduler_compare`.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import resource
import time

import numpy as np

from herald.bench import scheduler_compare
from herald.bench.scheduler_args import scheduler_config
from herald.bench.scheduler_threads import run_threads
from herald.contracts.plan import CAUSES
from herald.loader import SampleBatch, open_source
from herald.loader.splits import count_distinct_keys
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.simulate import quality_ratios, simulate, to_bytes
from herald.scheduler.state import Snapshots


def load_batches(spec: str, global_batch: int, max_rows=None, seed: int = 0):
    """All full global batches of a source, in source order (drop_last), and the table names."""
    src = open_source(spec)
    parts, n = [], 0
    try:
        while max_rows is None or n < max_rows:
            b = src.read(min(200_000, max_rows - n) if max_rows else 200_000)
            if b is None:
                break
            parts.append(b)
            n += len(b)
    finally:
        src.close()
    full = SampleBatch.concat(parts)
    batches = [full.slice(i, i + global_batch) for i in range(0, len(full) - global_batch + 1, global_batch)]
    return batches, full.table_names, len(full)


def _warm(ms: np.ndarray) -> np.ndarray:
    """Scheduling times after warm-up: Herald §6.1 drops the first 10 iterations (here they
    include loading the numba kernels and the first growth of the snapshots)."""
    skip = 10 if ms.shape[0] > 20 else 1
    return ms[skip:] if ms.shape[0] > skip else ms


def _reductions(results: dict) -> dict:
    v = results.get("vanilla")
    out = {}
    for name, r in results.items():
        ms = _warm(r.submit_ms)
        row = {
            "pulls": r.pulls,
            "pushes": r.pushes,
            "total": r.transmissions,
            "by_cause": r.by_cause(),
            "submit_ms_median": float(np.median(ms)),
            "submit_ms_p99": float(np.percentile(ms, 99)),
            "scored_tables": r.scored_tables,
        }
        if v is not None:
            row.update(
                pull_reduction=1 - r.pulls / v.pulls,
                push_reduction=1 - r.pushes / v.pushes,
                total_reduction=1 - r.transmissions / v.transmissions,
            )
        out[name] = row
    return out


def _print_table(rows: dict, bytes_total: dict) -> None:
    hdr = (
        f"{'schedule':10s} {'pulls':>9s} {'pushes':>9s} {'total':>9s} {'pull red':>9s} {'push red':>9s} "
        f"{'total red':>9s} {'GB moved':>9s} {'ms med':>7s} {'ms p99':>7s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows.items():
        red = lambda k: f"{100 * r[k]:8.1f}%" if k in r else f"{'-':>9s}"  # noqa: E731
        print(
            f"{name:10s} {r['pulls']:9d} {r['pushes']:9d} {r['total']:9d} {red('pull_reduction')} "
            f"{red('push_reduction')} {red('total_reduction')} {bytes_total[name] / 1e9:9.3f} "
            f"{r['submit_ms_median']:7.3f} {r['submit_ms_p99']:7.3f}"
        )


def _chart(rows: dict, path: pathlib.Path, title: str) -> None:
    # here, not at the top: the Agg backend is chosen before pyplot loads, and only when a chart is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    v = rows.get("vanilla")
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    x = np.arange(len(names))
    for j, key in enumerate(("pulls", "pushes", "total")):
        vals = [rows[n][key] / (v[key] if v else 1) for n in names]
        ax.bar(x + (j - 1) * width, vals, width, label=key)
    ax.set_xticks(x, names)
    ax.set_ylabel("transmissions / vanilla" if v else "transmissions")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_table(args) -> dict:
    """Herald Table 2 on ``args.data``: one simulation per schedule on the same batches."""
    G = args.workers * args.batch_size
    t0 = time.perf_counter()
    batches, tables, rows = load_batches(args.data, G, args.max_rows, args.seed)
    read_s = time.perf_counter() - t0
    if not batches:
        raise SystemExit(f"{args.data}: fewer than {G} rows")
    distinct = count_distinct_keys(batches)
    print(
        f"data {args.data}: {rows:,} rows, {len(tables)} tables, {len(batches)} global batches of {G}, "
        f"{distinct:,} distinct keys (read {read_s:.1f} s)"
    )
    results = {}
    for name in args.schedules.split(","):
        cfg = scheduler_config(args, name, scheduling_budget_ms=args.budget_ms)
        results[name] = simulate(batches, cfg, len(tables), distinct)
    cap = next(iter(results.values())).capacity_rows
    print(
        f"{args.workers} workers x {args.batch_size} samples, {args.cache_policy.upper()} cache of {cap:,} rows "
        f"per worker, dim {args.dim} {args.dtype}"
    )
    rows_out = _reductions(results)
    bytes_total = {n: int(to_bytes(r.counts, args.dim, args.dtype).sum()) for n, r in results.items()}
    _print_table(rows_out, bytes_total)
    if "herald" in results and "costaware" in results:
        h, c = results["herald"].transmissions, results["costaware"].transmissions
        print(f"costaware vs herald (static LAIA + plan): {100 * (1 - c / h):.1f}% fewer transmissions")
    return {
        "data": args.data,
        "rows": rows,
        "tables": list(tables),
        "steps": len(batches),
        "distinct_keys": distinct,
        "capacity_rows": cap,
        "dim": args.dim,
        "dtype": args.dtype,
        "schedules": rows_out,
        "bytes": bytes_total,
        "per_step_counts": {n: r.counts.tolist() for n, r in results.items()},
        "submit_ms": {n: r.submit_ms.tolist() for n, r in results.items()},
        "causes": list(CAUSES),
    }


def run_quality(args) -> dict:
    """Herald App. C: brute-force (step-optimal) transmissions / each schedule's."""
    W = args.quality_workers
    batches, tables, _ = load_batches(args.data, W, W * args.quality_steps, args.seed)
    distinct = count_distinct_keys(batches)
    cap = max(1, int(np.ceil(args.cache_ratio * distinct)))
    t0 = time.perf_counter()
    q = quality_ratios(
        batches,
        W,
        len(tables),
        cap,
        schedules=("laia", "herald", "costaware"),
        cache_policy=args.cache_policy,
        seed=args.seed,
    )
    print(
        f"quality (brute force / schedule), {W} workers x 1 sample, {len(batches)} steps, cache {cap} rows: "
        + ", ".join(f"{k} {v:.3f}" for k, v in q.items())
        + f"  ({time.perf_counter() - t0:.1f} s)"
    )
    return {"workers": W, "steps": len(batches), "capacity_rows": cap, "ratios": q}


def run_scaling(args) -> dict:
    """Scheduling time per global batch for 8/64 workers and 1,024/8,192 samples (26 tables)."""
    out = []
    for W, G in ((8, 1024), (64, 1024), (8, 8192), (64, 8192)):
        steps = 40 if G == 1024 else 12
        batches, tables, _ = load_batches(f"synthetic://criteo?rows={G * steps}&seed={args.seed}", G)
        distinct = count_distinct_keys(batches)
        for name in ("herald", "costaware"):
            cfg = SchedulerConfig(
                num_workers=W, batch_size_per_worker=G // W, schedule=name, cache_ratio=max(args.cache_ratio, 0.1)
            )
            try:
                r = simulate(batches, cfg, len(tables), distinct)
            except Exception as exc:  # a too-small cache at 8 workers x 1,024 samples
                print(f"scaling {name} W={W} G={G}: {exc}")
                continue
            ms = r.submit_ms[3:]
            nnz = sum(int(v.shape[0]) for v in batches[0].values)
            row = {
                "schedule": name,
                "workers": W,
                "global_batch": G,
                "nnz_per_batch": nnz,
                "ms_median": float(np.median(ms)),
                "ms_p99": float(np.percentile(ms, 99)),
                "ns_per_key": float(np.median(ms)) * 1e6 / nnz,
            }
            out.append(row)
            print(
                f"scaling {name:9s} W={W:2d} G={G:5d} nnz={nnz:6d}: median {row['ms_median']:.2f} ms, "
                f"p99 {row['ms_p99']:.2f} ms, {row['ns_per_key']:.0f} ns per key"
            )
    return {"rows": out}


def run_adaptive(args) -> dict:
    """Herald Fig. 13: transmissions of adaptive LAIA with k tables / static LAIA (herald)."""
    batches, tables, _ = load_batches(args.data, args.workers * args.batch_size, args.max_rows, args.seed)
    distinct = count_distinct_keys(batches)
    T = len(tables)
    ks = sorted({k for k in (1, 2, 4, 8, 13, T) if k <= T})
    out = []
    base = None
    for k in [None] + ks:
        cfg = scheduler_config(args, "herald", adaptive_num_tables=k)
        r = simulate(batches, cfg, T, distinct)
        if k is None:
            base = r.transmissions
            continue
        row = {
            "k": k,
            "transmissions": r.transmissions,
            "vs_static": r.transmissions / base,
            "ms_median": float(np.median(_warm(r.submit_ms))),
        }
        out.append(row)
        print(
            f"adaptive LAIA k={k:2d}/{T}: {row['vs_static']:.3f}x static transmissions, "
            f"{row['ms_median']:.3f} ms per batch"
        )
    return {"static_transmissions": base, "rows": out}


def run_memory(args) -> dict:
    """Snapshot bytes per tracked key with ``args.memory_keys`` keys (8 workers, 10% caches)."""
    n = args.memory_keys
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    snap = Snapshots(args.workers, max(1, int(0.1 * n)), "lru", initial_slots=n)
    chunk = 1 << 22
    rng = np.random.default_rng(args.seed)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        ids = rng.integers(0, 2**64 - 1, size=m, dtype=np.uint64, endpoint=True)
        snap.lookup(np.zeros(m, np.int16), ids)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    nbytes = snap.nbytes()
    out = {
        "keys": snap.num_keys,
        "workers": args.workers,
        "snapshot_bytes": nbytes,
        "bytes_per_key": nbytes / snap.num_keys,
        "peak_rss_growth_bytes": (rss1 - rss0) * 1024,
    }
    print(
        f"memory: {snap.num_keys:,} keys, {args.workers} workers: {nbytes / 1e9:.2f} GB of snapshot arrays, "
        f"{out['bytes_per_key']:.1f} B per key (peak RSS growth {out['peak_rss_growth_bytes'] / 1e9:.2f} GB)"
    )
    return out


def main(args) -> int:
    """Run the benchmark; writes ``scheduler_<data>.json`` and ``.png`` under ``args.out``.
    With ``--pool-vs-prange`` or ``--compare-ref`` runs that instead (it writes nothing).

    Raises:
        ConfigError: ``--cases`` is not a list of indices into ``scheduler_compare.CASES``.
    """
    if args.pool_vs_prange:
        batches, tables, _ = load_batches(scheduler_compare.CRITEO, 1024)
        return scheduler_compare.pool_vs_prange(batches, len(tables))
    if args.compare_ref:
        return scheduler_compare.compare(
            args.compare_ref,
            args.rounds,
            args.schedules.split(","),
            not args.no_plans,
            args.after_root or str(scheduler_compare.ROOT),
            scheduler_compare.case_indices(args.cases),
        )
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = "scheduler_" + "".join(ch if ch.isalnum() else "_" for ch in pathlib.Path(args.data).stem)[:60]
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "note": "timings on a shared machine are noisy",
        }
    }
    report["table"] = run_table(args)
    _chart(
        report["table"]["schedules"],
        outdir / f"{stem}.png",
        f"{args.data} - {args.workers} workers x {args.batch_size}, {args.cache_policy} cache {args.cache_ratio}",
    )
    if args.quality:
        report["quality"] = run_quality(args)
    if args.scaling:
        report["scaling"] = run_scaling(args)
    if args.adaptive:
        report["adaptive"] = run_adaptive(args)
    if args.threads:
        batches, tables, _ = load_batches(args.data, args.workers * args.batch_size, args.max_rows, args.seed)
        report["threads"] = run_threads(args, batches, len(tables))
    if args.memory_keys:
        report["memory"] = run_memory(args)
    path = outdir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} and {outdir / (stem + '.png')}")
    return 0
