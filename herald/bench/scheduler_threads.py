"""``herald bench scheduler --threads 1,2,4``: scheduling time per global batch vs threads,
and transmissions vs the single-threaded scheduler, measured in one run (Herald §4.4,
"Multi-threading"; §6.2.2 reports 7.7 ms per batch with 16 threads).

For each schedule (``herald``, ``herald`` with the lock-free allocation, ``costaware``)
and thread count, ``--rounds`` runs over the same batches, interleaved (round r runs every
thread count before round r + 1, so the load of a shared machine falls on all of them);
each run is a fresh :class:`Scheduler` building the plans (as the dispatcher does) after
one untimed warm-up run that loads the kernels. Times are ``submit`` wall time
(``Scheduler.submit_seconds``) of the warm steps of every round, pooled.
"""

from __future__ import annotations

import hashlib

import numba
import numpy as np

from herald.bench.scheduler_args import scheduler_config
from herald.loader.splits import count_distinct_keys
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.scheduler import Scheduler

#: (label, schedule, lock-free allocation)
VARIANTS = (("herald", "herald", False), ("herald lock-free", "herald", True), ("costaware", "costaware", False))


def _run(batches, cfg: SchedulerConfig, num_tables: int, distinct: int) -> tuple[np.ndarray, int, str]:
    """One run: warm per-step submit ms, total transmissions, and a digest of the allocations."""
    sched = Scheduler(cfg, num_tables, distinct, build_plans=True)
    digest = hashlib.sha256()
    total = 0
    for b in list(batches) + [None]:
        p = sched.submit(b) if b is not None else sched.finish()
        if p is not None:
            total += int(p.counts[:, 1:].sum())  # every cause but hit
            for a in p.assignment:
                digest.update(a.tobytes())
    ms = np.array(sched.submit_seconds) * 1e3
    skip = 10 if ms.shape[0] > 20 else 1  # Herald §6.1 drops the first 10 iterations
    return ms[skip:], total, digest.hexdigest()


def _runnable(args, pool: int) -> tuple[list[int], list[int]]:
    """``(thread counts measured, thread counts asked)``: 1 always measured, counts over numba's
    pool of ``pool`` threads left out (with a line saying why).

    Raises:
        SystemExit: ``--threads`` is not a comma list of counts >= 1.
    """
    counts = [int(x) for x in str(args.threads).split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--threads must be a comma list of thread counts >= 1, got {args.threads!r}")
    runnable = [n for n in counts if n <= pool]
    for n in sorted(set(counts) - set(runnable)):
        print(
            f"threads {n}: not measured: numba's thread pool has {pool} threads (NUMBA_NUM_THREADS, default the "
            f"cores of this host); set NUMBA_NUM_THREADS={n} to oversubscribe"
        )
    if 1 not in runnable:
        runnable = [1] + runnable  # the baseline of every comparison
    return runnable, counts


def _variant_rows(args, batches, num_tables: int, distinct: int, label: str, schedule: str, lock_free: bool, runnable):
    """The rows of one variant: ``args.rounds`` interleaved runs per thread count, each row's
    transmissions and allocation compared with 1 thread's."""
    cfgs = {n: scheduler_config(args, schedule, threads=n, lock_free_allocation=lock_free and n > 1) for n in runnable}
    for cfg in cfgs.values():  # warm-up: load / compile the kernels
        _run(batches[:3], cfg, num_tables, distinct)
    times = {n: [] for n in runnable}
    result = {}
    for _ in range(args.rounds):
        for n, cfg in cfgs.items():
            ms, total, digest = _run(batches, cfg, num_tables, distinct)
            times[n].append(ms)
            result[n] = (total, digest)
    base_total, base_digest = result[1]
    rows = []
    for n in runnable:
        ms = np.concatenate(times[n])
        total, digest = result[n]
        rows.append(
            {
                "variant": label,
                "threads": n,
                "steps": int(ms.shape[0]),
                "ms_median": float(np.median(ms)),
                "ms_p90": float(np.percentile(ms, 90)),
                "transmissions": total,
                "vs_1_thread": total / base_total - 1,
                "same_allocation": digest == base_digest,
            }
        )
    return rows


def run_threads(args, batches, num_tables: int) -> dict:
    """Time per batch vs threads, transmissions vs 1 thread; prints a table, returns rows."""
    pool = numba.config.NUMBA_NUM_THREADS
    runnable, counts = _runnable(args, pool)
    distinct = count_distinct_keys(batches)
    rows = []
    for label, schedule, lock_free in VARIANTS:
        rows += _variant_rows(args, batches, num_tables, distinct, label, schedule, lock_free, runnable)
    base = {r["variant"]: r["ms_median"] for r in rows if r["threads"] == 1}
    print(
        f"scheduling time vs threads ({args.workers} workers x {args.batch_size}, {num_tables} tables, "
        f"{len(batches)} batches x {args.rounds} rounds, wall ms per global batch; numba pool {pool} threads, "
        f"layer {numba.threading_layer() if len(runnable) > 1 else 'unused'}):"
    )
    print(
        f"{'variant':18s} {'threads':>7s} {'ms med':>7s} {'ms p90':>7s} {'speed-up':>8s} "
        f"{'transmissions':>13s} {'vs 1 thread':>11s} {'same alloc':>10s}"
    )
    for r in rows:
        print(
            f"{r['variant']:18s} {r['threads']:7d} {r['ms_median']:7.3f} {r['ms_p90']:7.3f} "
            f"{base[r['variant']] / r['ms_median']:7.2f}x {r['transmissions']:13d} "
            f"{100 * r['vs_1_thread']:+10.2f}% {r['same_allocation']!s:>10}"
        )
    return {
        "numba_pool_threads": pool,
        "rounds": args.rounds,
        "rows": rows,
        "not_measured": sorted(set(counts) - set(runnable)),
    }
