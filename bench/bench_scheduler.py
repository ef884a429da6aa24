"""Scheduler benchmark (same as ``herald bench scheduler``): Herald's Table 2 (pull, push and
total reduction vs vanilla for laia, plan, herald and costaware), scheduling time per global
batch, and optionally brute-force quality, scaling and snapshot memory.

Run: ``python bench/bench_scheduler.py --data ../shared/data/movielens/ml-latest-small/ratings.csv
--workers 8 --batch-size 128 --cache-ratio 0.1``. See :mod:`herald.bench.scheduler`.

``--compare-ref REF`` instead times ``submit`` of this checkout against the scheduler of git
revision ``REF`` (``git archive``) in the same run: for each case (Criteo sample, synthetic
Criteo, 64 workers, 8,192-sample batches) and schedule, baseline and current run in
alternating subprocesses (``--rounds`` each), the warm per-step times are pooled, and the
per-step counts of both must be identical (the optimisation may not change any
transmission). Prints a before / after table (median and p99, ms per global batch).
``--cases 0,1`` measures only those cases (indices into ``CASES``).

``--pool-vs-prange`` times the LRU snapshot pass of the Criteo sample (8 x 128, the largest
pass of a step) run serially, as the numba ``prange`` kernel the scheduler uses with 2
threads, and as the same per-worker function on a Python thread pool of 2 (one task plus
the calling thread): the measurement behind docs/scheduler.md "Parallel passes".
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.argv[1:2] != ["--timing-worker"]:  # a timing worker imports herald from its PYTHONPATH
    sys.path.insert(0, str(ROOT))  # run from a checkout

CRITEO = str(ROOT.parent / "shared/data/criteo/criteo_kaggle_sample_train.tsv")
#: (label, data, workers, samples per worker): 7, 195, 40, 12 and 12 global batches
CASES = (
    ("Criteo sample, 8 x 128", CRITEO, 8, 128),
    ("synthetic Criteo, 8 x 128", "synthetic://criteo?rows=200000&seed=0", 8, 128),
    ("synthetic Criteo, 64 x 16", "synthetic://criteo?rows=40960&seed=0", 64, 16),
    ("synthetic Criteo, 8 x 1,024", "synthetic://criteo?rows=98304&seed=0", 8, 1024),
    ("synthetic Criteo, 64 x 128", "synthetic://criteo?rows=98304&seed=0", 64, 128),
)


def timing_worker(data: str, schedule: str, workers: int, per_worker: int, build_plans: bool) -> None:
    """Child process: one run of ``Scheduler.submit`` over ``data``; prints JSON."""
    import hashlib

    import numpy as np

    from herald.bench.scheduler import load_batches
    from herald.loader.splits import count_distinct_keys
    from herald.scheduler.config import SchedulerConfig
    from herald.scheduler.scheduler import Scheduler

    batches, tables, _ = load_batches(data, workers * per_worker)
    distinct = count_distinct_keys(batches)
    cfg = SchedulerConfig(
        num_workers=workers, batch_size_per_worker=per_worker, schedule=schedule, cache_ratio=0.1, seed=0
    )
    warm = Scheduler(cfg, len(tables), distinct, build_plans=build_plans)  # compile every kernel
    for b in batches[:3]:
        warm.submit(b)
    warm.finish()
    sched = Scheduler(cfg, len(tables), distinct, build_plans=build_plans)
    digest = hashlib.sha256()
    cpu_ms = []
    for b in batches + [None]:
        t0 = time.thread_time()
        p = sched.submit(b) if b is not None else sched.finish()
        if b is not None:
            cpu_ms.append(1e3 * (time.thread_time() - t0))
        if p is not None:
            digest.update(np.ascontiguousarray(p.counts).tobytes())
    print(
        json.dumps(
            {"submit_ms": [1e3 * s for s in sched.submit_seconds], "cpu_ms": cpu_ms, "counts": digest.hexdigest()}
        )
    )


def pool_vs_prange(repeats: int = 200) -> int:
    """Serial / ``prange`` / thread-pool timings of one LRU snapshot pass (see the module doc)."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    import numba as nb
    import numpy as np

    from herald.bench.scheduler import load_batches
    from herald.loader.splits import count_distinct_keys
    from herald.scheduler import parallel_kernels as PK
    from herald.scheduler import snapshot_kernels as SK
    from herald.scheduler.config import SchedulerConfig
    from herald.scheduler.scheduler import Scheduler

    @nb.njit(nogil=True)
    def lru_workers(w0, w1, W, *args):  # the scheduler's per-worker function, for a range of workers
        for w in range(w0, w1):
            SK._lru_worker_jit(w, W, *args, True)

    batches, tables, _ = load_batches(CRITEO, 1024)
    sched = Scheduler(SchedulerConfig(), len(tables), count_distinct_keys(batches))
    seen = {}
    forward = sched.snapshots.before_forward

    def capture(keys, off, counts, threads=1):  # the state before step 4's snapshot pass
        seen.setdefault("state", (copy.deepcopy(sched.snapshots), keys.copy(), off.copy()))
        return forward(keys, off, counts, threads)

    for b in batches[:4]:
        sched.submit(b)
    sched.snapshots.before_forward = capture
    sched.submit(batches[4])
    snap0, keys, off = seen["state"]
    W = off.shape[0] - 1
    pool = ThreadPoolExecutor(2)

    def fresh():
        sn, n = copy.deepcopy(snap0), keys.shape[0]
        outs = (
            np.empty(n, np.int32),
            np.zeros(n, np.bool_),
            np.zeros(W, np.int64),
            np.empty(n, np.int32),
            np.zeros(W, np.int64),
            np.zeros((W, 6), np.int64),
        )
        return (
            keys,
            off,
            sn.cached,
            sn.valid,
            sn.owner,
            sn.capacity_rows,
            sn.pos,
            sn.log,
            sn.head,
            sn.tail,
            sn.size,
        ) + outs

    def serial(a):
        SK.snapshot_lru_step_jit(*a, np.zeros(2, np.int64))

    def prange2(a):
        nb.set_num_threads(2)
        PK.snapshot_lru_par_jit(*a, np.zeros(2, np.int64), 2)

    def pool2(a):
        f = pool.submit(lru_workers, W // 2, W, W, *a)
        lru_workers(0, W // 2, W, *a)
        f.result()

    runs = {f.__name__: [] for f in (serial, prange2, pool2)}
    for f in (serial, prange2, pool2):
        f(fresh())  # compile
    for _ in range(repeats // 20):
        for f in (serial, prange2, pool2):  # interleaved: the same machine load for each
            for _ in range(20):
                a = fresh()
                t0 = time.perf_counter()
                f(a)
                runs[f.__name__].append(time.perf_counter() - t0)
    print(f"LRU snapshot pass, Criteo sample 8 x 128 ({keys.shape[0]:,} keys), load {os.getloadavg()[0]:.2f}:")
    for name, v in runs.items():
        print(f"  {name:8s} median {1e3 * np.median(v):.3f} ms  p10 {1e3 * np.percentile(v, 10):.3f} ms")
    return 0


def _run_child(root: str, case, schedule: str, build_plans: bool) -> dict:
    _, data, W, Bw = case
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "bench_scheduler.py"),
        "--timing-worker",
        data,
        schedule,
        str(W),
        str(Bw),
        str(int(build_plans)),
    ]
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(ref: str, rounds: int, schedules: list, build_plans: bool, after_root: str = str(ROOT), cases=None) -> int:
    """Before (git ``ref``) / after (this checkout) table, measured in the same run.

    ``cases``: indices into :data:`CASES` (default all).
    """
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", ref, "herald"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        roots = {"before": tmp, "after": after_root}
        print(
            f"ms per global batch, median / p99 of warm steps, {rounds} alternating runs per side; "
            "wall = perf_counter around submit (what Scheduler.submit_seconds records), "
            "cpu = thread CPU time (excludes time the shared machine ran other processes)"
        )
        print("| case | schedule | wall before | wall after | speed-up | cpu before | cpu after | speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for case in CASES if cases is None else [CASES[i] for i in cases]:
            for schedule in schedules:
                ms = {k: [] for k in roots}
                cpu = {k: [] for k in roots}
                digests = {}
                for _ in range(rounds):
                    for k, root in roots.items():  # alternate: both see the same machine load
                        r = _run_child(root, case, schedule, build_plans)
                        skip = 10 if len(r["submit_ms"]) > 20 else 1  # warm steps only
                        ms[k].extend(r["submit_ms"][skip:])
                        cpu[k].extend(r["cpu_ms"][skip:])
                        digests.setdefault(k, set()).add(r["counts"])
                if digests["before"] != digests["after"] or len(digests["after"]) != 1:
                    raise SystemExit(f"{case[0]} {schedule}: per-step counts differ from {ref}")
                cells = []
                for series in (ms, cpu):
                    med = {k: float(np.median(v)) for k, v in series.items()}
                    p99 = {k: float(np.percentile(v, 99)) for k, v in series.items()}
                    cells += [f"{med[k]:.2f} / {p99[k]:.2f}" for k in roots]
                    cells.append(f"{med['before'] / med['after']:.2f}x")
                print(f"| {case[0]} | {schedule} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--timing-worker":
        d, s, w, b, plans = sys.argv[2:7]
        timing_worker(d, s, int(w), int(b), bool(int(plans)))
        sys.exit(0)
    from herald.bench.options import add_scheduler_arguments
    from herald.bench.scheduler import main

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scheduler_arguments(parser)
    parser.add_argument(
        "--compare-ref", default=None, help="time submit() of this checkout against git revision REF, same run"
    )
    parser.add_argument("--no-plans", action="store_true", help="--compare-ref: counts only (build_plans=False)")
    parser.add_argument("--cases", default=None, help="--compare-ref: comma-separated indices into CASES (default all)")
    parser.add_argument("--after-root", default=str(ROOT), help=argparse.SUPPRESS)  # a frozen copy
    parser.add_argument(
        "--pool-vs-prange",
        action="store_true",
        help="time one LRU snapshot pass serially, with prange and on a Python thread pool",
    )
    args = parser.parse_args()
    if args.pool_vs_prange:
        sys.exit(pool_vs_prange())
    if args.compare_ref:
        sys.exit(
            compare(
                args.compare_ref,
                args.rounds,
                args.schedules.split(","),
                not args.no_plans,
                args.after_root,
                None if args.cases is None else [int(c) for c in args.cases.split(",")],
            )
        )
    sys.exit(main(args))
