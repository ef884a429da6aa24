"""The options of every ``herald bench`` subcommand, and the constants their defaults show.

Only argparse and the standard library: :mod:`herald.bench.cli` builds every parser from
here without importing a bench module (they load torch or numba), and each bench module
imports its own ``add_*_arguments`` for its ``main`` and the constants it runs with.
"""

from __future__ import annotations

import argparse
import os

from herald.bench.options_device import add_device_arguments  # noqa: F401  (herald.bench.cli builds from here)

#: the schedules ``herald bench scheduler`` and ``herald bench network`` compare by default
COMPARED_SCHEDULES = ("vanilla", "laia", "plan", "herald", "costaware")


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ------------------------------------------------------------------ loader


def add_loader_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench loader``."""
    parser.add_argument("--rows", type=int, default=1_048_576, help="synthetic Criteo-shaped rows (default 1M)")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="repeats per measurement; medians are reported")
    parser.add_argument(
        "--torch-rows", type=int, default=65536, help="rows read through the torch DataLoader baseline (it is slow)"
    )
    parser.add_argument(
        "--criteo",
        default=None,
        help="Criteo TSV to time (default: ../shared/data/criteo/criteo_kaggle_sample_train.tsv)",
    )
    parser.add_argument("--workdir", default=None, help="where to write the Parquet file (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (smoke test)")


# ------------------------------------------------------------------ scheduler


def add_scheduler_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench scheduler``."""
    p.add_argument(
        "--data",
        default="../shared/data/movielens/ml-latest-small/ratings.csv",
        help="path or URL for herald.loader.open_source (synthetic://criteo?rows=N&seed=S)",
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128, help="samples per worker per step")
    p.add_argument("--cache-ratio", type=float, default=0.1, help="worker cache rows / distinct keys")
    p.add_argument("--cache-rows", type=int, default=None, help="worker cache rows (overrides --cache-ratio)")
    p.add_argument("--cache-policy", choices=("lru", "lfu"), default="lru")
    p.add_argument("--schedules", default=",".join(COMPARED_SCHEDULES))
    p.add_argument("--budget-ms", type=float, default=None, help="adaptive LAIA scheduling budget (ms)")
    p.add_argument("--max-rows", type=int, default=None, help="read at most this many rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=512, help="embedding dim for bytes (Herald §6.1: 512)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="out/bench_scheduler", help="folder for JSON and PNG")
    p.add_argument(
        "--quality",
        action="store_true",
        help="also brute-force quality (Herald App. C: per-worker batch 1, --quality-workers)",
    )
    p.add_argument("--quality-workers", type=int, default=8)
    p.add_argument("--quality-steps", type=int, default=150)
    p.add_argument(
        "--scaling",
        action="store_true",
        help="also time 8/64 workers x 1,024/8,192-sample global batches on synthetic Criteo",
    )
    p.add_argument("--memory-keys", type=int, default=0, help="also measure snapshot memory with N keys")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="also adaptive LAIA (Herald Fig. 13): herald scoring only the k highest-DoI tables",
    )
    p.add_argument(
        "--threads",
        default=None,
        metavar="N,N,...",
        help="also time herald, herald with the lock-free allocation, and costaware with these "
        "scheduler thread counts (e.g. 1,2,4; Herald §4.4): ms per batch vs threads and "
        "transmissions vs 1 thread",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved runs per thread count (--threads) or per side (--compare-ref)",
    )
    _add_scheduler_compare_arguments(p)


def _add_scheduler_compare_arguments(p: argparse.ArgumentParser) -> None:
    """``herald bench scheduler``'s options of :mod:`herald.bench.scheduler_compare` (instead of the table)."""
    p.add_argument(
        "--compare-ref",
        default=None,
        metavar="REF",
        help="instead: time submit() of this checkout against git revision REF, same run (per-step counts must match)",
    )
    p.add_argument("--no-plans", action="store_true", help="--compare-ref: counts only (build_plans=False)")
    p.add_argument("--cases", default=None, help="--compare-ref: comma-separated indices into CASES (default all)")
    p.add_argument("--after-root", default=None, help=argparse.SUPPRESS)  # a frozen copy of this checkout's herald
    p.add_argument(
        "--pool-vs-prange",
        action="store_true",
        help="instead: time one LRU snapshot pass serially, with prange and on a Python thread pool",
    )


# ------------------------------------------------------------------ kafka


def add_kafka_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench kafka``."""
    p.add_argument("--rows", type=int, default=200_000, help="samples published and read (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4096, help="max_rows per read() (default: %(default)s)")
    p.add_argument(
        "--rows-per-message", type=int, default=2048, help="samples per Arrow message (default: %(default)s)"
    )
    p.add_argument("--bootstrap", default=None, help="use this broker (api_version 0.9) instead of starting one")
    p.add_argument(
        "--criteo",
        default=None,
        help="Criteo TSV replicated to --rows (default: $HERALD_DATA/criteo/criteo_kaggle_sample_train.tsv, "
        "HERALD_DATA defaulting to ../shared/data beside the checkout)",
    )


# ------------------------------------------------------------------ ps


def add_ps_arguments(b: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench ps``."""
    b.add_argument("--dim", type=int, default=128, help="embedding dimension (float32)")
    b.add_argument("--keys", type=int, nargs="+", default=[1000, 10000], help="keys per request")
    b.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="client threads")
    b.add_argument("--seconds", type=float, default=0.3, help="measuring time per round")
    b.add_argument("--repeats", type=int, default=3, help="rounds per configuration (median reported)")
    b.add_argument(
        "--transport", nargs="+", default=["tcp", "ipc"], choices=["tcp", "ipc"], help="ZeroMQ transports to measure"
    )
    b.add_argument("--table-rows", type=int, default=200_000, help="distinct keys in the table")
    b.add_argument("--out", default="runs/bench-ps.json", help="JSON file for the results (default: %(default)s)")


# ------------------------------------------------------------------ step


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench step``."""
    p.add_argument("--workers", type=int, default=8, help="workers of the job (default: %(default)s)")
    p.add_argument("--shards", type=int, default=4, help="PS shards of the job (default: %(default)s)")
    p.add_argument("--shard", type=int, default=0, help="the shard replayed (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per worker per step (default: %(default)s)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default: %(default)s)")
    p.add_argument("--optimizer", default="rowwise_adagrad", help="sparse optimizer (default: %(default)s)")
    p.add_argument("--schedule", default="herald", help="scheduler schedule (default: %(default)s)")
    p.add_argument(
        "--cache-ratio", type=float, default=0.1, help="worker cache rows / distinct keys (default: %(default)s)"
    )
    p.add_argument("--wire-dtype", default="fp32", help="PS wire dtype (default: %(default)s)")
    p.add_argument(
        "--dense-params",
        type=int,
        default=None,
        metavar="P",
        help="dense gradient values each worker sends in its step messages, this shard summing its "
        "slice (NOTE [dense gradients on the shards]); 0: none (default: herald's DLRM on the data, "
        "27,601 on the synthetic Criteo rows)",
    )
    p.add_argument("--steps", type=int, default=10, help="steps measured (default: %(default)s)")
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="steps replayed first, untimed: kernels compiled, caches warm (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="replays of the same captured messages, each by a fresh shard and followed by its own "
        "numba limit; the figures are medians over them (default: %(default)s)",
    )
    p.add_argument("--source", default=None, help="default: synthetic://criteo?rows=ROWS&seed=SEED")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the results as JSON to this file")


# ------------------------------------------------------------------ dispatcher

#: rows of the capacity measurement's synthetic data (repeated as epochs as long as it runs)
CAPACITY_ROWS = 200_000
#: seconds the capacity is measured when no number of steps is given
CAPACITY_SECONDS = 5.0


def add_dispatcher_arguments(b: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench dispatcher``."""
    b.add_argument("--workers", type=int, default=8, help="workers served (default: %(default)s)")
    b.add_argument("--batch-size", type=int, default=256, help="samples per micro-batch (default: %(default)s)")
    b.add_argument("--schedule", default="herald", help="scheduler schedule (default: %(default)s)")
    b.add_argument(
        "--rows",
        type=int,
        default=CAPACITY_ROWS,
        help="rows of synthetic Criteo data, repeated as epochs (default: %(default)s)",
    )
    b.add_argument("--source", default=None, help="another source URL (default: synthetic://criteo?rows=ROWS)")
    b.add_argument("--steps", type=int, default=None, help="steps measured after the warm-up")
    b.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=f"seconds measured (default {CAPACITY_SECONDS} when --steps is not given)",
    )
    b.add_argument("--warmup-steps", type=int, default=30, help="steps before the clock starts (default: %(default)s)")
    b.add_argument("--max-inflight-steps", type=int, default=2, help="the dispatcher's credits (default: %(default)s)")
    b.add_argument(
        "--no-materialize",
        action="store_true",
        help="generate rows while serving (the generator's cost included) instead of from memory",
    )
    b.add_argument(
        "--peers-nice",
        type=int,
        default=0,
        help="nice increment (0-19) of the fake workers' process (default %(default)s: the dispatcher's priority)",
    )
    b.add_argument("--out", default=None, help="write the result as JSON to this file")


# ------------------------------------------------------------------ kernels

#: Our optimizer name -> FBGEMM's ``EmbOptimType`` member on the CPU (None: no CPU kernel).
FBGEMM_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adam": None,
}


def add_kernels_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench kernels``."""
    p.add_argument("--batch", type=int, default=256, help="samples per micro-batch (default: %(default)s)")
    p.add_argument("--tables", type=int, default=26, help="embedding tables (default: %(default)s, Criteo's)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    p.add_argument(
        "--bags",
        type=int,
        nargs="+",
        default=[1, 8],
        help="ids per bag: 1 one-hot, L > 1 lengths in [1, 2L - 1] (default: %(default)s)",
    )
    p.add_argument(
        "--rows-per-table",
        type=int,
        nargs="+",
        default=[10_000, 200_000],
        help="cached rows per table (default: %(default)s; memory ~ 2 x tables x rows x width x 4 B)",
    )
    p.add_argument("--optimizers", nargs="+", default=list(FBGEMM_OPTIMIZERS), choices=list(FBGEMM_OPTIMIZERS))
    p.add_argument("--reps", type=int, default=30, help="timed steps per case (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON to this file")


# ------------------------------------------------------------------ e2e


def add_e2e_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench e2e``."""
    p.add_argument("--source", default=None, help="default: synthetic://criteo?rows=ROWS&seed=1")
    p.add_argument("--rows", type=int, default=200_000, help="rows of the synthetic stream (default: %(default)s)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--cache-ratio", type=float, default=0.1)
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument(
        "--schedules",
        nargs="+",
        default=["vanilla", "herald", "costaware", "herald+replicated"],
        help="schedules to compare; NAME+replicated also holds the tables with at most "
        "--replicate-below ids on every worker (NOTE [replicated tables])",
    )
    p.add_argument("--replicate-below", type=int, default=15_000, help="(default: %(default)s)")
    p.add_argument("--no-torchrec", action="store_true", help="leave the TorchRec baseline out")
    p.add_argument("--out", default="runs/bench-e2e")


# ------------------------------------------------------------------ scale

#: batch sizes of the GPU section of ``herald bench scale``
GPU_BATCH_SIZES = (256, 4096)


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench scale``."""
    p.add_argument("--source", default=None, help="default: synthetic://criteo?rows=ROWS&seed=1")
    p.add_argument(
        "--rows",
        type=int,
        default=1_200_000,
        help="rows of the synthetic stream, enough to warm the caches (default: %(default)s)",
    )
    p.add_argument(
        "--max-workers",
        type=int,
        default=max(2, cores()),
        help="herald runs with 1, 2, 4, ... workers up to this (default: the cores, at least 2: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="samples per step of plain PyTorch and per worker per step of herald (default: %(default)s)",
    )
    p.add_argument("--schedules", nargs="+", default=["vanilla", "herald"], help="(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="run everything R times, report medians (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="model seed of every run (default: %(default)s)")
    p.add_argument(
        "--capacity-seconds",
        type=float,
        default=5.0,
        help="how long the dispatcher capacity is measured (default: %(default)s)",
    )
    p.add_argument("--no-capacity", action="store_true", help="skip the dispatcher capacity measurement")
    p.add_argument(
        "--gpu-batch-sizes",
        type=int,
        nargs="+",
        default=list(GPU_BATCH_SIZES),
        metavar="B",
        help="batch sizes of the GPU section, run when CUDA is available (default: %(default)s)",
    )
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU section (and TorchRec on CUDA)")
    p.add_argument("--no-torchrec", action="store_true", help="leave the TorchRec baselines out")
    p.add_argument(
        "--torchrec-workers",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="TorchRec at these N workers (default: every N of the herald runs)",
    )
    p.add_argument(
        "--pin-cores",
        action="store_true",
        help="run every herald job with --pin-cores (each worker and PS shard on cores of its own; "
        "the baseline already runs one torch thread)",
    )
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")


# ------------------------------------------------------------------ network


def add_network_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench network``."""
    p.add_argument("--source", default=None, help="default: synthetic://criteo?rows=ROWS&seed=1")
    p.add_argument("--rows", type=int, default=200_000, help="rows of the synthetic stream (default: %(default)s)")
    p.add_argument(
        "--workers",
        type=int,
        default=4 if (os.cpu_count() or 1) >= 8 else 2,
        help="worker hosts, one worker each (default: 4 with 8 cores or more, else 2; here %(default)s)",
    )
    p.add_argument("--batch-size", type=int, default=256, help="samples per worker and step (default: %(default)s)")
    p.add_argument(
        "--dim",
        type=int,
        nargs="+",
        default=[128],
        help="embedding dims to compare, e.g. --dim 128 512 (default: %(default)s)",
    )
    p.add_argument(
        "--rate", default="1gbit", help="each host link's rate per direction, a tc rate (default: %(default)s)"
    )
    p.add_argument(
        "--delay",
        type=float,
        default=None,
        help="each host link's one-way delay per direction, ms; > 0 needs the netem qdisc, 0: none "
        "(default: 0.2 where the kernel has netem, else none, with a warning and a delay_note in "
        "the JSON)",
    )
    p.add_argument("--cache-ratio", type=float, default=0.1, help="(default: %(default)s)")
    p.add_argument("--optimizer", default="sgd", help="sparse optimizer (default: %(default)s)")
    p.add_argument("--schedules", nargs="+", default=list(COMPARED_SCHEDULES), help="(default: %(default)s)")
    p.add_argument(
        "--eval-fraction", type=float, default=0.1, help="held-out fraction for the AUC (default: %(default)s)"
    )
    p.add_argument("--timeout-s", type=float, default=1800.0, help="bound on each job (default: %(default)s)")
    p.add_argument("--no-torchrec", action="store_true", help="leave the TorchRec baseline out")
    p.add_argument("--run-dir", default="runs/bench-network", help="jobs' folders and logs (default: %(default)s)")
    p.add_argument("--out", default=None, help="JSON results (default: RUN_DIR/bench_network.json)")


# ------------------------------------------------------------------ compression, groups

#: the datasets of ``herald bench compression`` and ``groups``, relative to ``--data-dir``
DATASETS = {"criteo": "criteo/criteo_kaggle_sample_train.tsv", "movielens": "movielens/ml-latest-small/ratings.csv"}


def add_compression_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench compression``."""
    p.add_argument("--data-dir", default="/work/shared/data", help="folder of the datasets (default: %(default)s)")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--wire-dtypes", nargs="+", default=["fp32", "fp16", "bf16", "int8"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=150, help="steps per job at most (default: %(default)s)")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--out", default="runs/bench-compression")


def add_groups_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench groups``."""
    p.add_argument("--data-dir", default="/work/shared/data", help="folder of the datasets (default: %(default)s)")
    p.add_argument("--dataset", default="movielens", choices=list(DATASETS))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--consistencies",
        nargs="+",
        default=["bsp", "hybrid"],
        choices=["bsp", "hybrid"],
        help="consistency modes to compare G under (default: %(default)s)",
    )
    p.add_argument("--slow-worker", default="3:50", help="straggler of the second pass, RANK:MS (default: %(default)s)")
    p.add_argument("--average-every", type=int, default=5)
    p.add_argument("--easgd-alpha", type=float, default=0.3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--out", default="runs/bench-groups")


# ------------------------------------------------------------------ consistency

CONSISTENCY_SOURCE = "/work/shared/data/criteo/criteo_kaggle_sample_train.tsv"
#: (label, consistency, its flags: the staleness bound s of bounded, the threshold iota of gba)
CONSISTENCY_MODES = (
    ("bsp", "bsp", {}),
    ("bounded s=1", "bounded", {"staleness": 1}),
    ("bounded s=4", "bounded", {"staleness": 4}),
    ("bounded s=16", "bounded", {"staleness": 16}),
    ("hybrid", "hybrid", {}),
    ("gba iota=0", "gba", {"gba_threshold": 0}),
    ("gba iota=4", "gba", {"gba_threshold": 4}),
)
#: the label of the row every other is compared with: exact BSP
BASELINE = CONSISTENCY_MODES[0][0]
#: --straggler: whose mean step time the straggler sleeps
STRAGGLERS = ("own", BASELINE)


def add_consistency_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench consistency``."""
    p.add_argument("--source", default=CONSISTENCY_SOURCE, help="training data (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--epochs", type=int, default=1, help="(default: %(default)s)")
    p.add_argument("--cache-ratio", type=float, default=0.1, help="(default: %(default)s)")
    p.add_argument("--embedding-dim", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--slow-rank", type=int, default=1, help="the straggler's rank (default: %(default)s)")
    p.add_argument(
        "--straggler",
        choices=STRAGGLERS,
        default="own",
        help="how long the straggler sleeps per step: own (each mode's own mean step time, measured in "
        "this run without a straggler: every straggler takes about 2x its own step) or bsp (BSP's "
        "mean step time for every mode) (default: %(default)s)",
    )
    p.add_argument(
        "--slow-ms",
        type=int,
        default=None,
        help="the straggler's extra milliseconds per step, for every mode (overrides --straggler)",
    )
    p.add_argument("--run-dir", default="runs/bench-consistency", help="job folders (default: %(default)s)")
    p.add_argument(
        "--modes",
        default=",".join(label for label, _, _ in CONSISTENCY_MODES),
        help="comma-separated labels of the modes to run (default: all: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=None, help="stop each job after this many steps (default: all data)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write every figure here")


# ------------------------------------------------------------------ din

#: sgd's lr on the embeddings: the gradient is that of the global batch's mean loss, so a row's
#: step is lr / (global batch) per sample touching it
DIN_SPARSE_LR = 50.0
DIN_SOURCE = "../shared/data/movielens/ml-latest-small/ratings.csv"


def add_din_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench din``."""
    p.add_argument("--source", default=DIN_SOURCE, help="a MovieLens ratings file (default: %(default)s)")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="model seeds, one run each (default: %(default)s)"
    )
    p.add_argument("--workers", type=int, default=2, help="herald's workers (default: %(default)s)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="samples per worker per step; the plain script's batch is the global batch (default: %(default)s)",
    )
    p.add_argument("--history", type=int, default=20, help="history length L of DIN (default: %(default)s)")
    p.add_argument("--embedding-dim", type=int, default=16, help="(default: %(default)s)")
    p.add_argument(
        "--lr", type=float, default=DIN_SPARSE_LR, help="sgd learning rate of the embeddings (default: %(default)s)"
    )
    p.add_argument(
        "--dense-lr",
        type=float,
        default=0.002,
        help="adam learning rate of the dense parameters (default: %(default)s)",
    )
    p.add_argument(
        "--eval-fraction", type=float, default=0.1, help="the last rows (in time), held out (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=None, help="stop every run after this many steps (default: 1 epoch)")
    p.add_argument("--run-dir", default="runs/bench-din", help="job folders (default: %(default)s)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write every figure here")
