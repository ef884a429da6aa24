"""``herald bench scheduler --compare-ref REF`` and ``--pool-vs-prange``: the scheduler's
speed against another revision of itself, and its snapshot pass on a Python thread pool.

``--compare-ref REF`` times ``submit`` of this checkout against the scheduler of git
revision ``REF`` (``git archive``) in the same run: for each case of :data:`CASES` and each
schedule, baseline and current run in alternating subprocesses
(:mod:`herald.bench.scheduler_timing`, ``--rounds`` each), the warm per-step times are
pooled, and the per-step counts of both must be identical (an optimisation may not change
any transmission). Prints a before / after table (median and p99, ms per global batch).
``--cases 0,1`` measures only those cases (indices into :data:`CASES`).

``--pool-vs-prange`` times the LRU snapshot pass of the Criteo sample (8 x 128, the largest
pass of a step) run serially, as the numba ``prange`` kernel the scheduler uses with 2
threads, and as the same per-worker function on a Python thread pool of 2 (one task plus
the calling thread): the measurement behind docs/scheduler.md "Parallel passes".
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np

from herald.bench.table import print_head
from herald.errors import ConfigError
from herald.loader import SampleBatch
from herald.loader.splits import count_distinct_keys
from herald.scheduler import parallel_kernels as PK
from herald.scheduler import snapshot_kernels as SK
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.scheduler import Scheduler
from herald.scheduler.state import step_outputs

#: the checkout this module runs from (``git archive`` reads the revision compared from it)
ROOT = pathlib.Path(__file__).resolve().parents[2]
CRITEO = str(ROOT.parent / "shared/data/criteo/criteo_kaggle_sample_train.tsv")
#: (label, data, workers, samples per worker): 7, 195, 40, 12 and 12 global batches
CASES = (
    ("Criteo sample, 8 x 128", CRITEO, 8, 128),
    ("synthetic Criteo, 8 x 128", "synthetic://criteo?rows=200000&seed=0", 8, 128),
    ("synthetic Criteo, 64 x 16", "synthetic://criteo?rows=40960&seed=0", 64, 16),
    ("synthetic Criteo, 8 x 1,024", "synthetic://criteo?rows=98304&seed=0", 8, 1024),
    ("synthetic Criteo, 64 x 128", "synthetic://criteo?rows=98304&seed=0", 64, 128),
)
_TIMING_WORKER = pathlib.Path(__file__).with_name("scheduler_timing.py")


def case_indices(cases: str | None) -> list[int]:
    """The indices into :data:`CASES` of ``--cases`` (``"0,2"``; None: every case).

    Raises:
        ConfigError: an index that is not an int in ``[0, len(CASES))``.
    """
    if cases is None:
        return list(range(len(CASES)))
    try:
        out = [int(c) for c in cases.split(",")]
    except ValueError:
        out = [-1]
    if not all(0 <= i < len(CASES) for i in out):
        raise ConfigError(f"--cases takes indices into CASES, 0 to {len(CASES) - 1} (e.g. 0,1), got {cases!r}")
    return out


def _run_child(root: str, case, schedule: str, build_plans: bool) -> dict:
    """One :mod:`herald.bench.scheduler_timing` run of ``case`` against the herald under ``root``."""
    _, data, W, Bw = case
    cmd = [sys.executable, "-P", str(_TIMING_WORKER), data, schedule, str(W), str(Bw), str(int(build_plans))]
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compare_case(roots: dict[str, str], case, schedule: str, rounds: int, build_plans: bool, ref: str) -> str:
    """The table row of one case and schedule: ``rounds`` alternating runs of each root."""
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
    return f"| {case[0]} | {schedule} | " + " | ".join(cells) + " |"


def compare(
    ref: str, rounds: int, schedules: list[str], build_plans: bool, after_root: str = str(ROOT), cases=None
) -> int:
    """Print the before (git ``ref``) / after (the herald under ``after_root``) table, measured in
    the same run; ``cases``: indices into :data:`CASES` (default all).

    Raises:
        SystemExit: the per-step counts of a case differ between the two sides.
        subprocess.CalledProcessError: ``git archive`` of ``ref`` or a timing run failed.
    """
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
        print_head("case | schedule | wall before | wall after | speed-up | cpu before | cpu after | speed-up", lead="")
        for case in CASES if cases is None else [CASES[i] for i in cases]:
            for schedule in schedules:
                print(_compare_case(roots, case, schedule, rounds, build_plans, ref), flush=True)
    return 0


# ------------------------------------------------------------------ --pool-vs-prange


@nb.njit(nogil=True)
def _lru_workers(w0, w1, W, *args):
    """The scheduler's per-worker LRU function for the workers ``w0 .. w1-1``."""
    for w in range(w0, w1):
        SK.lru_worker_jit(w, W, *args, True)


def _snapshot_before_step(batches: list[SampleBatch], num_tables: int, step: int):
    """``(snapshots, keys, offsets)`` right before step ``step``'s LRU snapshot pass."""
    sched = Scheduler(SchedulerConfig(), num_tables, count_distinct_keys(batches))
    seen = {}
    forward = sched.snapshots.before_forward

    def capture(keys, off, counts, threads=1):
        seen.setdefault("state", (copy.deepcopy(sched.snapshots), keys.copy(), off.copy()))
        return forward(keys, off, counts, threads)

    for b in batches[:step]:
        sched.submit(b)
    sched.snapshots.before_forward = capture
    sched.submit(batches[step])
    return seen["state"]


def _pass_arguments(snap0, keys: np.ndarray, off: np.ndarray) -> tuple:
    """The arguments ``(keys, off, cap, lru, out)`` of one LRU snapshot pass over a fresh copy of ``snap0``."""
    sn, n, W = copy.deepcopy(snap0), keys.shape[0], off.shape[0] - 1
    lru = tuple(getattr(sn, name) for name in SK.LRU_STATE)
    outs = step_outputs(n, W, np.zeros((W, 6), np.int64))
    return keys, off, sn.capacity_rows, lru, outs


def pool_vs_prange(batches: list[SampleBatch], num_tables: int, repeats: int = 200) -> int:
    """Print the serial / ``prange`` / thread-pool timings of one LRU snapshot pass (the module
    doc) over step 4 of ``batches`` (the Criteo sample's 1,024-sample global batches)."""
    snap0, keys, off = _snapshot_before_step(batches, num_tables, 4)
    W = off.shape[0] - 1
    pool = ThreadPoolExecutor(2)

    def serial(a):
        SK.snapshot_lru_step_jit(*a, np.zeros(2, np.int64))

    def prange2(a):
        nb.set_num_threads(2)
        PK.snapshot_lru_par_jit(*a, np.zeros(2, np.int64), 2)

    def pool2(a):
        f = pool.submit(_lru_workers, W // 2, W, W, *a)
        _lru_workers(0, W // 2, W, *a)
        f.result()

    runs = {f.__name__: [] for f in (serial, prange2, pool2)}
    for f in (serial, prange2, pool2):
        f(_pass_arguments(snap0, keys, off))  # compile
    for _ in range(repeats // 20):
        for f in (serial, prange2, pool2):  # interleaved: the same machine load for each
            for _ in range(20):
                a = _pass_arguments(snap0, keys, off)
                t0 = time.perf_counter()
                f(a)
                runs[f.__name__].append(time.perf_counter() - t0)
    pool.shutdown()
    print(f"LRU snapshot pass, Criteo sample 8 x 128 ({keys.shape[0]:,} keys), load {os.getloadavg()[0]:.2f}:")
    for name, v in runs.items():
        print(f"  {name:8s} median {1e3 * np.median(v):.3f} ms  p10 {1e3 * np.percentile(v, 10):.3f} ms")
    return 0
