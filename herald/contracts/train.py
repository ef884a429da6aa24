"""The settings of a job as a user gives them: :class:`TrainConfig` (``herald train`` and
``herald serve dispatcher``; their options are generated from it). Validated on
construction, naming the flag.

Imports no numba/torch/zmq package, so that ``herald train`` checks its options in well
under a second, before anything starts (herald/cli.py).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any

from herald.config import flags_of, from_flags, key_value, nested, parse_value, require, setting
from herald.contracts.comm import check_comm
from herald.contracts.consistency import ModeContext, ModeSettings, Straggler
from herald.contracts.flags import _flag, _integer, _number, flag_errors, scheduling_budget_value
from herald.contracts.models import check_model
from herald.contracts.modes import MODE_FLAGS, BspSettings, check_mode, consistency_mode
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.vocab import (
    CACHE_DEVICES,
    CACHE_POLICIES,
    DEFAULT_TIMEOUT_MS,
    DENSE_COMM_DTYPES,
    DENSE_OPTIMIZERS,
    DEVICE_PATTERN,
    LAUNCHERS,
    MAX_BRUTEFORCE_WORKERS,
    MAX_EMBEDDING_DIM,
    MAX_TIMEOUT_MS,
    MAX_WORKERS,
    MODELS,
    SCHEDULES,
    SPARSE_OPTIMIZERS,
    WIRE_DTYPES,
)

DEFAULT_SOURCE = "synthetic://criteo?rows=600000&seed=0"
#: Worker cache rows for a kafka:// stream without --cache-rows: a stream has no known
#: set of keys to take --cache-ratio of.
STREAM_CACHE_ROWS = 100_000
#: ``--model auto`` on a known dataset: Herald's workload table (Herald
#: Table 1: W1 Criteo + Wide&Deep, W2 MovieLens + NCF, W3 Avazu + DeepFM), keyed by the
#: source's format. Other sources (synthetic, Parquet, libFM, Kafka) keep the shape rule
#: of :func:`auto_model`, so the synthetic default still trains DLRM.
WORKLOAD_MODELS = {"criteo": "wdl", "movielens": "ncf", "avazu": "deepfm"}
#: The settings that roll a job back to its latest checkpoint when one of its processes is
#: lost, each cause its own budget (NOTE [worker failover] in herald/job/rollback.py).
RESTART_BUDGETS = ("ps_restarts", "worker_restarts")


def source_option(text: str) -> tuple[str, Any]:
    """argparse type of ``--source-option KEY=VALUE`` (value by :func:`herald.config.parse_value`)."""
    key, value = key_value(text)
    return key, parse_value(value)


def auto_model(model: str, dataset: str | None, num_tables: int, dense_dim: int) -> str:
    """The model ``--model auto`` trains (any other name is returned as it is).

    Args:
        model: a name of :data:`MODELS`; dataset: the source's format name (``criteo``,
            ``avazu``, ``movielens``, ``synthetic``, ...) or None; num_tables, dense_dim:
            the source's schema.

    Returns:
        ``WORKLOAD_MODELS[dataset]`` for a known dataset (Herald's workloads),
        else ``ncf`` for two tables without dense features, else ``dlrm``.
    """
    if model != "auto":
        return model
    if dataset in WORKLOAD_MODELS:
        return WORKLOAD_MODELS[dataset]
    return "ncf" if num_tables == 2 and dense_dim == 0 else "dlrm"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one ``herald train`` job; each field is the option ``--field-name``
    (``herald train --help``). Validated on construction, naming the flag.

    Raises:
        ConfigError: a value out of range or a combination that cannot work.
    """

    source: str = setting(
        DEFAULT_SOURCE,
        "input: a file (Criteo .tsv, Avazu .csv, MovieLens ratings.csv or u.data, "
        "Frappe .libfm, herald .parquet), a kafka://HOST:PORT/TOPIC?format=arrow"
        "&group=G stream, or synthetic://criteo?rows=N&seed=S",
    )
    source_options: tuple[tuple[str, Any], ...] = setting(
        (),
        "an option of the source (e.g. bad_records=skip, threshold=4); repeatable",
        flag="--source-option",
        action="append",
        type=source_option,
        metavar="KEY=VALUE",
    )
    schedule: str = setting(
        "herald",
        "herald (LAIA allocation + communication plan), costaware (our cost-aware "
        "allocation + communication plan), laia (LAIA allocation + full-set sync), "
        "plan (random partition + communication plan), vanilla (random partition + "
        "full-set sync: the baseline), optimal (brute-force allocation: --batch-size 1, "
        "<= 8 workers)",
        choices=SCHEDULES,
    )
    mode: ModeSettings = nested(BspSettings, flags=MODE_FLAGS)  # --consistency and its mode's options
    slow_worker: str | None = setting(
        None, "straggler injection for experiments: worker RANK sleeps MS milliseconds once per step", metavar="RANK:MS"
    )
    wire_dtype: str = setting(
        "fp32",
        "embedding rows and gradients on the PS wire (the PS keeps fp32; docs/compression.md)",
        choices=WIRE_DTYPES,
    )
    dense_comm: str = setting("fp32", "dense all-reduce payload (DDP compress hooks)", choices=DENSE_COMM_DTYPES)
    groups: int = setting(
        1,
        "Hierarchical Training's dense half: G dense replicas, each all-reduced within its "
        "group and averaged between groups in the background by EASGD (1: one replica); "
        "with --consistency hybrid each group has its own dispatcher and share of the data, "
        "with bsp and bounded the groups stay in lockstep under one dispatcher, not with gba",
        metavar="G",
    )
    average_every: int = setting(10, "steps between a group's EASGD averagings", metavar="STEPS")
    easgd_alpha: float = setting(0.3, "--groups > 1: EASGD elastic moving rate in (0, 1)", metavar="ALPHA")
    scheduling_budget: str | float | None = setting(
        None,
        "adaptive LAIA (Herald §4.3; --schedule herald, laia or costaware): allocation scores only the "
        "tables with the highest degree of infrequency that fit a scheduling time per global batch of: auto "
        "(half of the measured training step, so the scheduler stays off the critical path) or MS "
        "milliseconds; k is never lowered when even one table would not fit; k over time is in the report "
        "(default: static, every table). With CPU workers auto keeps every table, so it trains as static: "
        "scoring is not the cost (measured: scheduling ~1.5 ms of a 35-45 ms step, docs/scheduler.md); k "
        "drops only where scheduling takes over half a step (short GPU steps)",
        metavar="auto|MS",
        type=scheduling_budget_value,
    )
    scheduler_threads: int = setting(
        1,
        "threads of the scheduler's per-table, per-sample and per-worker passes "
        "(Herald §4.4); the plans do not depend on it",
        metavar="N",
    )
    workers: int = setting(2, "number of workers")
    batch_size: int = setting(128, "samples per worker per step; global batch = workers x batch size")
    cache_ratio: float = setting(0.1, "worker cache size as a fraction of the distinct keys in the training split")
    cache_rows: int | None = setting(
        None, f"worker cache size in rows (overrides --cache-ratio; default for a kafka:// stream: {STREAM_CACHE_ROWS})"
    )
    cache_policy: str = setting("lru", "worker cache eviction policy", choices=CACHE_POLICIES)
    embedding_dim: int = setting(16, "embedding dimension of every table")
    optimizer: str = setting("rowwise_adagrad", "sparse optimizer of the embeddings", choices=SPARSE_OPTIMIZERS)
    lr: float = setting(0.05, "sparse learning rate")
    dense_optimizer: str = setting("adam", "optimizer of the dense parameters", choices=DENSE_OPTIMIZERS)
    dense_lr: float = setting(0.001, "dense learning rate")
    model: str = setting(
        "auto",
        "dlrm, wdl (Wide&Deep), deepfm, dcn (DCN v2) or ncf; auto = the Herald workload "
        "model of a known dataset (Criteo .tsv: wdl, MovieLens: ncf, Avazu .csv: deepfm), "
        "else ncf for two tables without dense features, else dlrm; wdl and deepfm use "
        "the last element of each embedding row as the id's scalar weight "
        "(docs/models.md)",
        choices=MODELS,
    )
    epochs: int = setting(1, "passes over the training split")
    steps: int | None = setting(None, "stop after this many steps of the job (default: all data)")
    eval_fraction: float = setting(0.1, "the last fraction of the rows is held out for evaluation")
    ps_shards: int | None = setting(
        None, "parameter-server shards (processes; default: one per 4 cores of this host, at most 8, at least 1)"
    )
    seed: int = setting(0, "seed of the model initialisation and of the random allocations")
    run_dir: str = setting("runs/latest", "where logs, checkpoints and the report go")
    max_inflight_steps: int | None = setting(
        None,
        "steps the dispatcher sends ahead of the slowest worker's ack "
        "(credits; default: 3 in bsp and bounded, so the next micro-batch "
        "is there before a step's message goes out; 2 in hybrid, where "
        "they bound staleness, and gba)",
        metavar="STEPS",
    )
    timeout_ms: int = setting(
        DEFAULT_TIMEOUT_MS,
        "longest wait for any peer before it is reported by name; the "
        "start-up waits (the workers' hellos, each worker's wait for the "
        "job) last at least 60 s however short this is",
    )
    ps_restarts: int = setting(
        0,
        "when a PS shard dies, roll the whole job back to its latest checkpoint and go on, at "
        "most this many times (Persia-style failover; needs --checkpoint-every)",
        metavar="N",
    )
    worker_restarts: int = setting(
        0,
        "when a worker process dies (killed by a signal, crashed) or goes silent, roll "
        "the whole job back to its latest checkpoint and go on, at most this many "
        "times (needs --checkpoint-every); a worker that reports an error of its own "
        "(a diverged loss, a bad setting) still ends the job (docs/operations.md)",
        metavar="N",
    )
    ps_max_rows: int = setting(
        0,
        "rows one table holds at most on each PS shard; least recently used rows beyond it "
        "are evicted and re-initialised on their next touch (Persia's LRU PS; 0: no bound). "
        "Approximate: an evicted row read again comes back from its initialiser, having "
        "forgotten its training; the report counts the evicted rows read again",
        metavar="ROWS",
    )
    checkpoint_every: int = setting(
        0,
        "checkpoint PS rows, dense state and source position every STEPS steps; "
        "kafka:// sources commit their offsets only with a checkpoint (0: at the end "
        "only for kafka://, never for files)",
        metavar="STEPS",
    )
    resume: bool = setting(
        False,
        "continue the job from the latest checkpoint in --run-dir (any source; write "
        "checkpoints with --checkpoint-every): PS rows, dense state and data position are "
        "restored and training goes on exactly as if never stopped; --steps counts the "
        "job's total steps",
    )
    eval_every: int = setting(
        100,
        "print progressive validation (AUC, log loss of predictions made before each update) every STEPS steps",
        metavar="STEPS",
    )
    log_sample_ids: bool = setting(
        False, "append the sample ids of every trained step to RUN_DIR/trained_sample_ids.u64"
    )
    replicate_below: int = setting(
        0,
        "hold every table with at most IDS distinct ids (training split) whole on "
        "every worker, synchronised by all-reduce instead of the PS (0: off)",
        metavar="IDS",
    )
    device: str = setting(
        "auto",
        "training device of every worker: auto (cuda:LOCAL_RANK %% GPUs when CUDA is "
        "available, else cpu), cpu, cuda (one GPU per worker, shared round-robin when "
        "there are more workers than GPUs), cuda:N (every worker on GPU N); NCCL only "
        "when each worker has a GPU of its own, else gloo",
        metavar="DEVICE",
    )
    cache_device: str = setting(
        "auto",
        "where each worker's embedding cache lives: auto (on the GPU when the "
        "device is one, else host memory), cpu (host memory: caches larger than "
        "GPU memory), torch (torch rows on the training device, also on the CPU)",
        choices=CACHE_DEVICES,
    )
    pin_cores: bool = setting(
        False,
        "pin each process of the job (every worker, every PS shard, this process with "
        "its dispatcher) to cores of its own, so that they do not share a core: the cores "
        "this process may use split evenly, each worker's torch threads one per core "
        "(unless OMP_NUM_THREADS is set); with more processes than cores, one core each, "
        "round-robin (said in the log) (Linux)",
    )
    keys_dir: str | None = setting(
        None,
        "CURVE keys folder (herald keys generate DIR): every role authenticates "
        "and encrypts its ZeroMQ traffic with it (NOTE [transport security], "
        "docs/operations.md)",
        flag="--keys",
        metavar="DIR",
    )
    insecure: bool = setting(
        False, "let a role bind a non-loopback address without --keys (unauthenticated, unencrypted; warns)"
    )
    launcher: str = setting(
        "local",
        "who runs the PS shards and the workers: local (processes of this host) or ray "
        "(Ray actors with resource requests, placed over the nodes of a Ray cluster; "
        "the dispatcher stays in this process: docs/cluster.md)",
        choices=LAUNCHERS,
    )
    ray_address: str | None = setting(
        None,
        "--launcher ray: the Ray cluster to run on, as ray.init takes it (auto: "
        "the cluster of this node; host:port of its head); default: $RAY_ADDRESS "
        "when set (ray job submit sets it), else a local Ray instance started for "
        "the job and stopped after. Not ray:// (Ray Client): this process runs "
        "the dispatcher, which the workers must reach",
        metavar="ADDRESS",
    )
    storage_path: str | None = setting(
        None,
        "--launcher ray: a folder every node of the cluster mounts at the same "
        "path (NFS, a shared volume); the run folder (--run-dir) is then "
        "STORAGE_PATH/RUN_DIR. Default: --run-dir itself, which every node "
        "running a role must then see (checked before the roles start)",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        """Check every setting before any process starts, naming the flag ."""
        require(
            isinstance(self.source, str) and self.source.strip() != "",
            f"--source must be a path or URL, got {self.source!r}",
        )
        require(
            isinstance(self.source_options, tuple)
            and all(
                isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) and kv[0]
                for kv in self.source_options
            ),
            f"--source-option must be KEY=VALUE pairs, got {self.source_options!r}",
        )
        for name, choices in (
            ("schedule", SCHEDULES),
            ("cache_policy", CACHE_POLICIES),
            ("optimizer", SPARSE_OPTIMIZERS),
            ("dense_optimizer", DENSE_OPTIMIZERS),
            ("model", MODELS),
        ):
            value = getattr(self, name)
            require(value in choices, f"{_flag(name)} must be one of {', '.join(choices)}, got {value!r}")
        _integer(self, "workers", 1, MAX_WORKERS)
        Straggler.parse(self.slow_worker, self.workers)
        check_comm(self.wire_dtype, self.dense_comm, self.groups, self.average_every, self.easgd_alpha, self.workers)
        _integer(self, "batch_size", 1)
        _integer(self, "cache_rows", 1, optional=True)
        _integer(self, "embedding_dim", 1, MAX_EMBEDDING_DIM)
        _integer(self, "epochs", 1)
        _integer(self, "steps", 1, optional=True)
        _integer(self, "ps_shards", 1, 64, optional=True)
        _integer(self, "seed", 0, 2**63 - 1)
        _integer(self, "max_inflight_steps", 1, optional=True)
        _integer(self, "timeout_ms", 100, MAX_TIMEOUT_MS)
        _integer(self, "ps_max_rows", 0)
        _integer(self, "checkpoint_every", 0)
        for name in RESTART_BUDGETS:
            _integer(self, name, 0)
            require(
                getattr(self, name) == 0 or self.checkpoint_every > 0,
                f"{_flag(name)} {getattr(self, name)} rolls the job back to its latest checkpoint, and without "
                f"--checkpoint-every there is none: add --checkpoint-every STEPS (and --run-dir) or leave "
                f"{_flag(name)} out",
            )
        _integer(self, "eval_every", 1)
        _integer(self, "replicate_below", 0)
        check_mode(self.mode, self.mode_context)
        _integer(self, "scheduler_threads", 1, 256)
        budget = self.scheduling_budget
        require(
            budget is None
            or budget == "auto"
            or (
                isinstance(budget, numbers.Real)
                and not isinstance(budget, bool)
                and math.isfinite(budget)
                and budget > 0
            ),
            f"--scheduling-budget must be auto or a number of milliseconds > 0, got {budget!r}",
        )
        require(
            budget is None or self.schedule in ("herald", "laia", "costaware"),
            f"--scheduling-budget adapts the LAIA / costaware allocation: use it with --schedule herald, laia "
            f"or costaware, not {self.schedule}",
        )
        require(
            isinstance(self.device, str) and re.fullmatch(DEVICE_PATTERN, self.device) is not None,
            f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        require(
            self.cache_device in CACHE_DEVICES,
            f"--cache-device must be one of {', '.join(CACHE_DEVICES)}, got {self.cache_device!r}",
        )
        _number(self, "lr", "> 0", lambda x: x > 0)
        _number(self, "dense_lr", "> 0", lambda x: x > 0)
        _number(self, "cache_ratio", "in (0, 1]", lambda x: 0 < x <= 1)
        _number(self, "eval_fraction", "in [0, 1)", lambda x: 0 <= x < 1)
        require(
            isinstance(self.run_dir, str) and self.run_dir.strip() != "",
            f"--run-dir must be a folder path, got {self.run_dir!r}",
        )
        require(
            self.keys_dir is None or (isinstance(self.keys_dir, str) and self.keys_dir.strip() != ""),
            f"--keys must be a folder path, got {self.keys_dir!r}",
        )
        for name in ("resume", "log_sample_ids", "insecure", "pin_cores"):
            require(
                isinstance(getattr(self, name), bool),
                f"{_flag(name)} is a switch (True/False), got {getattr(self, name)!r}",
            )
        require(
            not self.pin_cores or hasattr(os, "sched_setaffinity"),
            "--pin-cores needs os.sched_setaffinity (Linux); leave it out on this system",
        )
        check_model(self.model, None, self.embedding_dim)  # the tables: check_schema, once the source is open
        require(
            self.schedule != "optimal" or (self.batch_size == 1 and self.workers <= MAX_BRUTEFORCE_WORKERS),
            f"--schedule optimal (brute force) needs --batch-size 1 and --workers <= {MAX_BRUTEFORCE_WORKERS}, got "
            f"--batch-size {self.batch_size} --workers {self.workers}",
        )
        require(
            not (self.replicate_below and self.is_stream),
            "--replicate-below needs the distinct ids of each table from a pre-pass; a kafka:// stream has none",
        )
        self._check_launcher()

    def _check_launcher(self) -> None:
        """``--launcher`` and the Ray settings (docs/cluster.md); with ``--storage-path`` the
        run folder becomes ``STORAGE_PATH/RUN_DIR`` (a path already inside it is kept, so a
        ``dataclasses.replace`` of the settings keeps it too)."""
        require(self.launcher in LAUNCHERS, f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        for name in ("ray_address", "storage_path"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, str) and value.strip() != ""),
                f"{_flag(name)} must be a non-empty string, got {value!r}",
            )
            require(
                value is None or self.launcher == "ray",
                f"{_flag(name)} is a setting of the Ray launcher: add --launcher ray, or leave {_flag(name)} out",
            )
        if self.launcher != "ray":
            return
        require(
            not (self.ray_address or "").startswith("ray://"),
            f"--ray-address {self.ray_address}: Ray Client (ray://) runs this process off the cluster, and the "
            "workers must reach its dispatcher: run herald train on a node of the cluster (ray job submit -- "
            "herald train --launcher ray --ray-address auto ..., or a KubeRay RayJob: docs/cluster.md)",
        )
        require(
            not re.fullmatch(r"cuda:[0-9]+", self.device),
            f"--device {self.device}: under --launcher ray each worker is given one GPU of its own by Ray: use "
            "--device cuda (or auto: GPUs when the cluster has one per worker)",
        )
        require(
            not self.pin_cores,
            "--pin-cores pins the processes of this host; under --launcher ray Ray places "
            "the PS shards and workers, each with its CPU request: leave --pin-cores out",
        )
        if self.storage_path is not None:
            storage = os.path.normpath(os.path.abspath(self.storage_path))
            run = os.path.normpath(os.path.join(storage, self.run_dir))
            require(
                os.path.commonpath([storage, run]) == storage,
                f"--run-dir {self.run_dir} is outside --storage-path {self.storage_path}: give a --run-dir "
                "relative to the storage path (the run folder is STORAGE_PATH/RUN_DIR)",
            )
            object.__setattr__(self, "run_dir", run)  # frozen: normalised once, on construction

    @classmethod
    def from_flags(cls, values: Any = None, /, *, where: str = "", **flags: Any) -> TrainConfig:
        """The settings from options by flag name, as the command line gives them
        (``TrainConfig.from_flags(consistency="bounded", staleness=4)`` is ``--consistency
        bounded --staleness 4``; a mapping and keywords together: keywords win).

        Raises:
            ConfigError: an unknown name (the known ones listed) or a bad value, naming the flag.
        """
        return from_flags(cls, {**dict(values or {}), **flags}, where=where or "herald train")

    def flags(self) -> dict[str, Any]:
        """Every setting by flag name (inverse of :meth:`from_flags`; JSON-able but for
        ``source_options``, a tuple of pairs)."""
        return flags_of(self)

    def with_flags(self, **flags: Any) -> TrainConfig:
        """A copy with the settings ``flags`` (by flag name) changed, validated again."""
        return self.from_flags(self.flags(), **flags)

    @property
    def consistency(self) -> str:
        """The consistency mode's name (``--consistency``): ``mode.name``."""
        return self.mode.name

    @property
    def straggler(self) -> Straggler:
        """``--slow-worker`` parsed (:class:`~herald.contracts.consistency.Straggler`; rank -1: none)."""
        return Straggler.parse(self.slow_worker)

    @property
    def mode_context(self) -> ModeContext:
        """What the mode's settings are checked against (:func:`herald.contracts.modes.check_mode`)."""
        return ModeContext(
            workers=self.workers,
            global_batch=self.workers * self.batch_size,
            replicated=self.replicate_below > 0,
            groups=self.groups,
            resume=self.resume,
            checkpoint_every=self.checkpoint_every,
        )

    @property
    def is_stream(self) -> bool:
        return self.source.startswith("kafka://")

    def tables(self, schema) -> list[TableConfig]:
        """One table config per table of ``schema`` (same dim and sparse optimizer).

        Args:
            schema: a :class:`herald.loader.batch.Schema` (its ``table_names`` are read).

        Raises:
            ConfigError: worded with the flags (:func:`flag_errors`).
        """
        with flag_errors():
            opt = OptimizerConfig(name=self.optimizer, lr=self.lr)
            return [TableConfig(name=n, dim=self.embedding_dim, optimizer=opt) for n in schema.table_names]

    def check_schema(self, schema, dataset: str | None) -> None:
        """Check the settings that need the source's schema, naming the flag: the model
        ``--model`` trains (``auto`` resolved by :func:`auto_model`) against the source's
        tables and ``--embedding-dim`` (:func:`herald.contracts.models.check_model`, the one
        statement of what each model needs). :class:`herald.job.data.JobData` runs it as
        soon as the source is open: before any pass over the data and before any process
        of the job starts.

        Args:
            schema: a :class:`herald.loader.batch.Schema` (``num_tables``, ``dense_dim``,
                ``table_names`` are read); dataset: the source's format name, or None.

        Raises:
            ConfigError: a model the source cannot feed.
        """
        model = auto_model(self.model, dataset, schema.num_tables, schema.dense_dim)
        check_model(
            model, schema.num_tables, self.embedding_dim, chosen_as=self.model, table_names=tuple(schema.table_names)
        )

    @property
    def num_ps_shards(self) -> int:
        """``ps_shards``, or the default for this host's cores (a PS shard is one thread)."""
        if self.ps_shards is not None:
            return self.ps_shards
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(8, cores // 4))

    @property
    def inflight_steps(self) -> int:
        """``max_inflight_steps``, or the default of the consistency mode
        (:attr:`herald.contracts.modes.ConsistencyMode.inflight_steps`)."""
        if self.max_inflight_steps is not None:
            return self.max_inflight_steps
        return consistency_mode(self.consistency).inflight_steps

    @property
    def global_batch(self) -> int:
        return self.workers * self.batch_size
