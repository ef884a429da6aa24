"""The settings of a job: :class:`TrainConfig` (what ``herald train`` and ``herald serve
dispatcher`` are given; their options are generated from it) and :class:`JobSpec`
(the versioned contract every worker receives from the dispatcher).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import pathlib
import re
from typing import TYPE_CHECKING, Any, Mapping

from herald.config import from_mapping, key_value, parse_value, require, setting
from herald.job.flags import _flag, _integer, _number, flag_errors, scheduling_budget_value
from herald.errors import ConfigError
from herald.worker.comm_settings import DENSE_COMM_DTYPES, WIRE_DTYPES, check_comm
from herald.worker.consistency_settings import (CONSISTENCY_MODES, check_consistency, check_gba, check_hybrid,
                                                parse_slow_worker)

if TYPE_CHECKING:
    from herald.job.data import JobData
    from herald.ps import TableConfig

# This module imports no numba/torch/zmq package (herald.ps, herald.scheduler are
# imported where used), so that ``herald train`` checks its options in well under a
# second, before anything starts (herald/cli.py). tests/job/test_spec.py checks that
# these copies equal herald.scheduler.config's SCHEDULES and MAX_WORKERS.
SCHEDULES = ("costaware", "herald", "laia", "optimal", "plan", "vanilla")
MAX_WORKERS = 64
MAX_EMBEDDING_DIM = 4096
MAX_TIMEOUT_MS = 86_400_000   # a day

DEFAULT_SOURCE = "synthetic://criteo?rows=600000&seed=0"
#: Worker cache rows for a kafka:// stream without --cache-rows: a stream has no known
#: set of keys to take --cache-ratio of.
STREAM_CACHE_ROWS = 100_000
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
MODELS = ("auto", "dlrm", "ncf", "wdl", "deepfm", "dcn")
#: ``--model auto`` on a known dataset: the Herald paper's workload table (herald-nsdi24
#: Table 1: W1 Criteo + Wide&Deep, W2 MovieLens + NCF, W3 Avazu + DeepFM), keyed by the
#: source's format. Other sources (synthetic, Parquet, libFM, Kafka) keep the shape rule
#: of :func:`auto_model`, so the synthetic default still trains DLRM.
WORKLOAD_MODELS = {"criteo": "wdl", "movielens": "ncf", "avazu": "deepfm"}
#: Models reading the last element of each row as a scalar weight (NOTE [scalar slice]
#: in herald/worker/models.py): they need rows of at least 2 elements.
SCALAR_SLICE_MODELS = ("wdl", "deepfm")
CACHE_POLICIES = ("lru", "lfu")
#: ``--device`` values (NOTE [worker devices] in herald/worker/devices.py) and ``--cache-device`` choices.
DEVICE_PATTERN = r"auto|cpu|cuda(:[0-9]+)?"
CACHE_DEVICES = ("auto", "cpu", "torch")


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

    source: str = setting(DEFAULT_SOURCE, "input: a file (Criteo .tsv, Avazu .csv, MovieLens ratings.csv or u.data, "
                                          "Frappe .libfm, herald .parquet), a kafka://HOST:PORT/TOPIC?format=arrow"
                                          "&group=G stream, or synthetic://criteo?rows=N&seed=S")
    source_options: tuple[tuple[str, Any], ...] = setting(
        (), "an option of the source (e.g. bad_records=skip, threshold=4); repeatable", flag="--source-option",
        action="append", type=source_option, metavar="KEY=VALUE")
    schedule: str = setting("herald", "herald (LAIA allocation + communication plan), costaware (our cost-aware "
                                      "allocation + communication plan), laia (LAIA allocation + full-set sync), "
                                      "plan (random partition + communication plan), vanilla (random partition + "
                                      "full-set sync: the baseline), optimal (brute-force allocation: --batch-size 1, "
                                      "<= 8 workers)", choices=SCHEDULES)
    consistency: str = setting("bsp", "consistency protocol of the embeddings: bsp (exact, equal to "
                                      "single-process training), bounded (HET clock-bounded reads: a cached copy "
                                      "at most --staleness updates behind is read instead of re-pulled; "
                                      "docs/consistency.md)", choices=CONSISTENCY_MODES)
    staleness: int = setting(0, "--consistency bounded: staleness bound s in updates of one embedding "
                                "(0 = exact BSP)", metavar="S")
    hybrid_expiry: int | None = setting(None, "hybrid: drop and count gradients over STEPS steps late", metavar="STEPS")
    gba_buffer: int = setting(0, "gba: gradients aggregated per global step, M (0: --workers)", metavar="M")
    gba_threshold: int = setting(0, "gba: drop (count) gradients > IOTA global steps stale", metavar="IOTA")
    slow_worker: str | None = setting(None, "straggler injection for experiments: worker RANK sleeps MS "
                                            "milliseconds once per step", metavar="RANK:MS")
    wire_dtype: str = setting("fp32", "embedding rows and gradients on the PS wire (the PS keeps fp32; "
                                      "docs/compression.md)", choices=WIRE_DTYPES)
    dense_comm: str = setting("fp32", "dense all-reduce payload (DDP compress hooks)", choices=DENSE_COMM_DTYPES)
    groups: int = setting(1, "HT groups: G dense replicas averaged in the background by EASGD (1: BSP); with "
                             "--consistency hybrid each group has its own dispatcher and share of the data",
                          metavar="G")
    average_every: int = setting(10, "steps between a group's EASGD averagings", metavar="STEPS")
    easgd_alpha: float = setting(0.3, "--groups > 1: EASGD elastic moving rate in (0, 1)", metavar="ALPHA")
    scheduling_budget: str | float | None = setting(
        None, "adaptive LAIA (Herald §4.3; --schedule herald, laia or costaware): allocation scores only the "
              "tables with the highest degree of infrequency that fit a scheduling time per global batch of: auto "
              "(half of the measured training step, so the scheduler stays off the critical path) or MS "
              "milliseconds; k is never lowered when even one table would not fit; k over time is in the report "
              "(default: static, every table)", metavar="auto|MS", type=scheduling_budget_value)
    scheduler_threads: int = setting(1, "threads of the scheduler's per-table, per-sample and per-worker passes "
                                        "(Herald §4.4); the plans do not depend on it", metavar="N")
    workers: int = setting(2, "number of workers")
    batch_size: int = setting(128, "samples per worker per step; global batch = workers x batch size")
    cache_ratio: float = setting(0.1, "worker cache size as a fraction of the distinct keys in the training split")
    cache_rows: int | None = setting(None, "worker cache size in rows (overrides --cache-ratio; default for a "
                                           f"kafka:// stream: {STREAM_CACHE_ROWS})")
    cache_policy: str = setting("lru", "worker cache eviction policy", choices=CACHE_POLICIES)
    embedding_dim: int = setting(16, "embedding dimension of every table")
    optimizer: str = setting("rowwise_adagrad", "sparse optimizer of the embeddings", choices=SPARSE_OPTIMIZERS)
    lr: float = setting(0.05, "sparse learning rate")
    dense_optimizer: str = setting("adam", "optimizer of the dense parameters", choices=DENSE_OPTIMIZERS)
    dense_lr: float = setting(0.001, "dense learning rate")
    model: str = setting("auto", "dlrm, wdl (Wide&Deep), deepfm, dcn (DCN v2) or ncf; auto = the Herald workload "
                                 "model of a known dataset (Criteo .tsv: wdl, MovieLens: ncf, Avazu .csv: deepfm), "
                                 "else ncf for two tables without dense features, else dlrm; wdl and deepfm use "
                                 "the last element of each embedding row as the id's scalar weight "
                                 "(docs/models.md)", choices=MODELS)
    epochs: int = setting(1, "passes over the training split")
    steps: int | None = setting(None, "stop after this many steps of the job (default: all data)")
    eval_fraction: float = setting(0.1, "the last fraction of the rows is held out for evaluation")
    ps_shards: int | None = setting(None, "parameter-server shards (processes; default: one per 4 cores of this "
                                          "host, at most 8, at least 1)")
    seed: int = setting(0, "seed of the model initialisation and of the random allocations")
    run_dir: str = setting("runs/latest", "where logs, checkpoints and the report go")
    max_inflight_steps: int = setting(2, "steps the dispatcher sends ahead of the slowest worker's ack (credits)",
                                      metavar="STEPS")
    timeout_ms: int = setting(120_000, "longest wait for any peer before it is reported by name")
    ps_restarts: int = setting(0, "when a PS shard dies, roll the whole job back to its latest checkpoint and go on, at "
                                  "most this many times (Persia-style failover; needs --checkpoint-every)",
                               metavar="N")
    ps_max_rows: int = setting(0, "rows one table holds at most on each PS shard; least recently used rows beyond it "
                                  "are evicted and re-initialised on their next touch (Persia's LRU PS; 0: no bound)",
                               metavar="ROWS")
    checkpoint_every: int = setting(0, "checkpoint PS rows, dense state and source position every STEPS steps; "
                                       "kafka:// sources commit their offsets only with a checkpoint (0: at the end "
                                       "only for kafka://, never for files)", metavar="STEPS")
    resume: bool = setting(False, "continue the job from the latest checkpoint in --run-dir (any source; write "
                                  "checkpoints with --checkpoint-every): PS rows, dense state and data position are "
                                  "restored and training goes on exactly as if never stopped; --steps counts the "
                                  "job's total steps")
    eval_every: int = setting(100, "print progressive validation (AUC, log loss of predictions made before each "
                                   "update) every STEPS steps", metavar="STEPS")
    log_sample_ids: bool = setting(False, "append the sample ids of every trained step to "
                                          "RUN_DIR/trained_sample_ids.u64")
    replicate_below: int = setting(0, "hold every table with at most IDS distinct ids (training split) whole on "
                                      "every worker, synchronised by all-reduce instead of the PS (0: off)",
                                   metavar="IDS")
    device: str = setting("auto", "training device of every worker: auto (cuda:LOCAL_RANK %% GPUs when CUDA is "
                                  "available, else cpu), cpu, cuda (one GPU per worker, shared round-robin when "
                                  "there are more workers than GPUs), cuda:N (every worker on GPU N); NCCL only "
                                  "when each worker has a GPU of its own, else gloo", metavar="DEVICE")
    cache_device: str = setting("auto", "where each worker's embedding cache lives: auto (on the GPU when the "
                                        "device is one, else host memory), cpu (host memory: caches larger than "
                                        "GPU memory), torch (torch rows on the training device, also on the CPU)",
                                choices=CACHE_DEVICES)
    keys_dir: str | None = setting(None, "CURVE keys folder (herald keys generate DIR): every role authenticates "
                                         "and encrypts its ZeroMQ traffic with it (NOTE [transport security], "
                                         "docs/operations.md)", flag="--keys", metavar="DIR")
    insecure: bool = setting(False, "let a role bind a non-loopback address without --keys (unauthenticated, "
                                    "unencrypted; warns)")

    def __post_init__(self) -> None:
        """Check every setting before any process starts, naming the flag (STYLE habit 3)."""
        require(isinstance(self.source, str) and self.source.strip() != "",
                f"--source must be a path or URL, got {self.source!r}")
        require(isinstance(self.source_options, tuple) and all(
            isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) and kv[0] for kv in self.source_options),
            f"--source-option must be KEY=VALUE pairs, got {self.source_options!r}")
        for name, choices in (("schedule", SCHEDULES), ("consistency", CONSISTENCY_MODES),
                              ("cache_policy", CACHE_POLICIES), ("optimizer", SPARSE_OPTIMIZERS),
                              ("dense_optimizer", DENSE_OPTIMIZERS), ("model", MODELS)):
            value = getattr(self, name)
            require(value in choices, f"{_flag(name)} must be one of {', '.join(choices)}, got {value!r}")
        _integer(self, "workers", 1, MAX_WORKERS)
        check_consistency(self.consistency, self.staleness)
        parse_slow_worker(self.slow_worker, self.workers)
        check_comm(self.wire_dtype, self.dense_comm, self.groups, self.average_every, self.easgd_alpha, self.workers)
        _integer(self, "batch_size", 1)
        _integer(self, "cache_rows", 1, optional=True)
        _integer(self, "embedding_dim", 1, MAX_EMBEDDING_DIM)
        _integer(self, "epochs", 1)
        _integer(self, "steps", 1, optional=True)
        _integer(self, "ps_shards", 1, 64, optional=True)
        _integer(self, "seed", 0, 2**63 - 1)
        _integer(self, "max_inflight_steps", 1)
        _integer(self, "timeout_ms", 100, MAX_TIMEOUT_MS)
        _integer(self, "ps_max_rows", 0)
        _integer(self, "ps_restarts", 0)
        _integer(self, "checkpoint_every", 0)
        _integer(self, "eval_every", 1)
        _integer(self, "replicate_below", 0)
        check_hybrid(self.consistency, self.hybrid_expiry, self.replicate_below > 0)
        check_gba(self.consistency, self.gba_buffer, self.gba_threshold, workers=self.workers, resume=self.resume,
                  global_batch=self.workers * self.batch_size, checkpoint_every=self.checkpoint_every,
                  replicated=self.replicate_below > 0, groups=self.groups)
        _integer(self, "scheduler_threads", 1, 256)
        budget = self.scheduling_budget
        require(budget is None or budget == "auto" or (isinstance(budget, numbers.Real) and not isinstance(
            budget, bool) and math.isfinite(budget) and budget > 0),
                f"--scheduling-budget must be auto or a number of milliseconds > 0, got {budget!r}")
        require(budget is None or self.schedule in ("herald", "laia", "costaware"),
                f"--scheduling-budget adapts the LAIA / costaware allocation: use it with --schedule herald, laia "
                f"or costaware, not {self.schedule}")
        require(isinstance(self.device, str) and re.fullmatch(DEVICE_PATTERN, self.device) is not None,
                f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        require(self.cache_device in CACHE_DEVICES,
                f"--cache-device must be one of {', '.join(CACHE_DEVICES)}, got {self.cache_device!r}")
        _number(self, "lr", "> 0", lambda x: x > 0)
        _number(self, "dense_lr", "> 0", lambda x: x > 0)
        _number(self, "cache_ratio", "in (0, 1]", lambda x: 0 < x <= 1)
        _number(self, "eval_fraction", "in [0, 1)", lambda x: 0 <= x < 1)
        require(isinstance(self.run_dir, str) and self.run_dir.strip() != "",
                f"--run-dir must be a folder path, got {self.run_dir!r}")
        require(self.keys_dir is None or (isinstance(self.keys_dir, str) and self.keys_dir.strip() != ""),
                f"--keys must be a folder path, got {self.keys_dir!r}")
        for name in ("resume", "log_sample_ids", "insecure"):
            require(isinstance(getattr(self, name), bool), f"{_flag(name)} is a switch (True/False), got "
                                                            f"{getattr(self, name)!r}")
        require(self.model not in SCALAR_SLICE_MODELS or self.embedding_dim >= 2,
                f"--model {self.model} needs --embedding-dim >= 2 (the last element of each row is the id's scalar "
                f"weight), got {self.embedding_dim}")
        require(self.schedule != "optimal" or (self.batch_size == 1 and self.workers <= 8),
                "--schedule optimal (brute force) needs --batch-size 1 and --workers <= 8, got "
                f"--batch-size {self.batch_size} --workers {self.workers}")
        require(not (self.replicate_below and self.is_stream),
                "--replicate-below needs the distinct ids of each table from a pre-pass; a kafka:// stream has none")

    @property
    def is_stream(self) -> bool:
        return self.source.startswith("kafka://")

    def tables(self, schema) -> list[TableConfig]:
        """One table config per table of ``schema`` (same dim and sparse optimizer).

        Raises:
            ConfigError: worded with the flags (:func:`flag_errors`).
        """
        from herald.ps import OptimizerConfig, TableConfig

        with flag_errors():
            opt = OptimizerConfig(name=self.optimizer, lr=self.lr)
            return [TableConfig(name=n, dim=self.embedding_dim, optimizer=opt) for n in schema.table_names]

    @property
    def num_ps_shards(self) -> int:
        """``ps_shards``, or the default for this host's cores (a PS shard is one thread)."""
        if self.ps_shards is not None:
            return self.ps_shards
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(8, cores // 4))

    @property
    def global_batch(self) -> int:
        return self.workers * self.batch_size


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What every process of a job must agree on: sent by the dispatcher to each worker
    in its ``config`` message (NOTE [dispatch protocol]) as :meth:`to_dict`, read by
    the worker runtime, the report and the single-process reference trainer.

    Attributes:
        tables: the embedding tables (dim, sparse optimizer), in table order.
        dense_dim: dense features per sample; model: one of :data:`MODELS` (``auto``
            resolved by :meth:`build`: :func:`auto_model`); seed:
            seed of the dense model (equal replicas on every rank).
        dense_optimizer, dense_lr: the dense optimizer (``sgd``/``adagrad``/``adam``).
        ps: PS shard endpoints in shard order; ps_timeout_ms: longest wait for a shard.
        consistency, staleness: the consistency protocol (NOTE [step protocol]; ``bsp`` or
            ``bounded`` with its staleness bound: docs/consistency.md).
        slow_worker_rank, slow_worker_ms: straggler injection (``--slow-worker``): that rank
            sleeps that many ms once per step (rank -1: none); hybrid_expiry_steps: ``--hybrid-expiry``;
            gba_buffer, gba_threshold: GBA's M (resolved) and iota (NOTE [gba tokens]).
        wire_dtype, dense_comm, groups, average_every, easgd_alpha: wire compression and
            hierarchical training groups (docs/compression.md; checked by
            :func:`herald.worker.comm_settings.check_comm`).
        group_index: -1: one dispatcher serves every rank; ``g`` >= 0: this job's dispatcher
            serves only group ``g``'s ranks, as its ranks 0..k-1 (NOTE [independent groups]
            in herald/job/group_dispatch.py; the worker's torch.distributed rank is ``g * k + r``).
        run_dir: where workers write their dense replicas at the end (None: nowhere).
        dist_init: torch.distributed init method (None: ``env://`` under torchrun).
        resume_dense: checkpoint folder whose ``dense.pt`` the workers load, or None.
        keys_dir: the CURVE keys folder of the job's PS shards (NOTE [transport security]
            in herald/auth.py), or None. Only the path travels: every host reads the
            keys from its own copy of the folder; a worker's own ``--keys`` wins.
        replicated_tables, replica_rows: NOTE [replicated tables] (herald/worker/replicas.py).
        capacity_rows, num_workers: set by the dispatcher (cache rows per worker, ranks).

    Raises:
        ConfigError: from :meth:`from_dict`: another version, an unknown key, or a bad value.
    """

    VERSION = 1

    tables: tuple[TableConfig, ...]
    dense_dim: int
    ps: tuple[str, ...]
    model: str = "auto"
    seed: int = 0
    dense_optimizer: str = "sgd"
    dense_lr: float = 0.01
    ps_timeout_ms: int = 30_000
    consistency: str = "bsp"
    run_dir: str | None = None
    dist_init: str | None = None
    resume_dense: str | None = None
    replicated_tables: tuple[int, ...] = ()
    replica_rows: int = 0
    capacity_rows: int = 0
    num_workers: int = 0
    keys_dir: str | None = None
    staleness: int = 0
    slow_worker_rank: int = -1
    slow_worker_ms: int = 0
    hybrid_expiry_steps: int | None = None
    gba_buffer: int = 0
    gba_threshold: int = 0
    wire_dtype: str = "fp32"
    dense_comm: str = "fp32"
    groups: int = 1
    average_every: int = 10
    easgd_alpha: float = 0.3
    group_index: int = -1

    def __post_init__(self) -> None:
        from herald.ps import TableConfig

        require(len(self.tables) >= 1 and all(isinstance(t, TableConfig) for t in self.tables),
                "a job needs at least one TableConfig")
        require(len(self.ps) >= 1, "a job needs at least one PS shard endpoint")
        require(self.dense_dim >= 0, f"dense_dim must be >= 0, got {self.dense_dim}")
        require(self.model in MODELS, f"model must be one of {MODELS}, got {self.model!r}")
        require(self.model not in SCALAR_SLICE_MODELS or min(t.dim for t in self.tables) >= 2,
                f"model {self.model} needs table dim >= 2 (the last element of each row is the id's scalar weight); "
                "set --embedding-dim 2 or more, or choose another --model")
        require(self.dense_optimizer in DENSE_OPTIMIZERS,
                f"dense optimizer must be one of {DENSE_OPTIMIZERS}, got {self.dense_optimizer!r}")
        check_consistency(self.consistency, self.staleness)
        check_hybrid(self.consistency, self.hybrid_expiry_steps, bool(self.replicated_tables))
        check_gba(self.consistency, self.gba_buffer, self.gba_threshold, replicated=bool(self.replicated_tables))
        check_comm(self.wire_dtype, self.dense_comm, self.groups, self.average_every, self.easgd_alpha)
        require(type(self.slow_worker_rank) is int and type(self.slow_worker_ms) is int and self.slow_worker_ms >= 0,
                f"slow_worker_rank and slow_worker_ms must be ints, got {self.slow_worker_rank!r}, "
                f"{self.slow_worker_ms!r}")
        require(self.ps_timeout_ms >= 1 and self.capacity_rows >= 0 and self.replica_rows >= 0,
                "ps_timeout_ms must be >= 1, capacity_rows and replica_rows >= 0")
        require(all(0 <= t < len(self.tables) for t in self.replicated_tables),
                f"replicated_tables {self.replicated_tables} must index the {len(self.tables)} tables")
        require(self.keys_dir is None or isinstance(self.keys_dir, str), f"keys_dir must be a path or None, got "
                                                                         f"{type(self.keys_dir).__name__}")
        require(type(self.group_index) is int and -1 <= self.group_index < self.groups,
                f"group_index must be -1 or a group below groups {self.groups}, got {self.group_index!r}")

    @classmethod
    def build(cls, cfg: TrainConfig, data: "JobData", ps_addresses: list[str]) -> "JobSpec":
        """The spec of the job ``cfg`` reading ``data``, served by the PS at ``ps_addresses``."""
        with flag_errors():
            return cls(tables=tuple(cfg.tables(data.schema)), dense_dim=data.schema.dense_dim,
                       ps=tuple(ps_addresses),
                       model=auto_model(cfg.model, data.dataset, data.schema.num_tables, data.schema.dense_dim),
                       seed=cfg.seed, dense_optimizer=cfg.dense_optimizer,
                       dense_lr=cfg.dense_lr, ps_timeout_ms=cfg.timeout_ms, consistency=cfg.consistency,
                       run_dir=str(pathlib.Path(cfg.run_dir).resolve()),
                       replicated_tables=tuple(data.replicated), replica_rows=data.replica_rows,
                       keys_dir=str(pathlib.Path(cfg.keys_dir).resolve()) if cfg.keys_dir else None,
                       staleness=cfg.staleness, hybrid_expiry_steps=cfg.hybrid_expiry,
                       gba_buffer=cfg.gba_buffer or (cfg.workers if cfg.consistency == "gba" else 0),
                       gba_threshold=cfg.gba_threshold, wire_dtype=cfg.wire_dtype,
                       dense_comm=cfg.dense_comm, groups=cfg.groups, average_every=cfg.average_every,
                       easgd_alpha=float(cfg.easgd_alpha),
                       **dict(zip(("slow_worker_rank", "slow_worker_ms"), parse_slow_worker(cfg.slow_worker))))

    def replace(self, **changes: Any) -> "JobSpec":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-able dict with a ``version`` key (inverse: :meth:`from_dict`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(version=self.VERSION, tables=[t.to_dict() for t in self.tables], ps=list(self.ps),
                   replicated_tables=list(self.replicated_tables))
        return out

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> "JobSpec":
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: not a mapping, another version, an unknown key, or a bad value.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"a job spec must be a mapping, got {type(mapping).__name__}")
        values = dict(mapping)
        version = values.pop("version", None)
        if version != cls.VERSION:
            raise ConfigError(f"job spec version {version!r} is not {cls.VERSION}: run the same herald version "
                              "on the dispatcher and every worker")
        from herald.ps import TableConfig

        try:
            values["tables"] = tuple(TableConfig.from_dict(t) for t in values.get("tables", ()))
            values["ps"] = tuple(values.get("ps", ()))
            values["replicated_tables"] = tuple(int(t) for t in values.get("replicated_tables", ()))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed job spec: {exc}") from None
        return from_mapping(cls, values, where="job spec")

    @property
    def dim(self) -> int:
        """The embedding dim shared by every table (the worker cache needs one).

        Raises:
            ConfigError: tables differ in dim or optimizer-state width.
        """
        dims = {(t.dim, t.row_width) for t in self.tables}
        if len(dims) != 1:
            raise ConfigError("the worker cache needs every table to share dim and optimizer state width, got "
                              f"{sorted(dims)}; give all tables the same dim and optimizer")
        return next(iter(dims))[0]
