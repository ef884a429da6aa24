"""The settings of a job: :class:`TrainConfig` (what ``herald train`` and ``herald serve
dispatcher`` are given; their options are generated from it) and :class:`JobSpec`
(the versioned contract every worker receives from the dispatcher).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import TYPE_CHECKING, Any, Mapping

from herald.config import from_mapping, key_value, parse_value, require, setting
from herald.errors import ConfigError
from herald.ps import OptimizerConfig, TableConfig
from herald.scheduler.config import SCHEDULES

if TYPE_CHECKING:
    from herald.job.data import JobData

DEFAULT_SOURCE = "synthetic://criteo?rows=600000&seed=0"
#: Worker cache rows for a kafka:// stream without --cache-rows: a stream has no known
#: set of keys to take --cache-ratio of.
STREAM_CACHE_ROWS = 100_000
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
MODELS = ("auto", "dlrm", "ncf")
CONSISTENCY_MODES = ("bsp",)


def source_option(text: str) -> tuple[str, Any]:
    """argparse type of ``--source-option KEY=VALUE`` (value by :func:`herald.config.parse_value`)."""
    key, value = key_value(text)
    return key, parse_value(value)


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
    schedule: str = setting("herald", "herald (LAIA + communication plan), costaware (our cost-aware allocation + "
                                      "plan), laia, plan, vanilla (random + full-set sync), optimal (brute force, "
                                      "tiny jobs only)", choices=sorted(SCHEDULES))
    consistency: str = setting("bsp", "consistency protocol of the embeddings: bsp (exact, equal to "
                                      "single-process training)", choices=CONSISTENCY_MODES)
    workers: int = setting(2, "number of workers")
    batch_size: int = setting(128, "samples per worker per step; global batch = workers x batch size")
    cache_ratio: float = setting(0.1, "worker cache size as a fraction of the distinct keys in the training split")
    cache_rows: int | None = setting(None, "worker cache size in rows (overrides --cache-ratio; default for a "
                                           f"kafka:// stream: {STREAM_CACHE_ROWS})")
    cache_policy: str = setting("lru", "worker cache eviction policy", choices=("lru", "lfu"))
    embedding_dim: int = setting(16, "embedding dimension of every table")
    optimizer: str = setting("rowwise_adagrad", "sparse optimizer of the embeddings", choices=SPARSE_OPTIMIZERS)
    lr: float = setting(0.05, "sparse learning rate")
    dense_optimizer: str = setting("adam", "optimizer of the dense parameters", choices=DENSE_OPTIMIZERS)
    dense_lr: float = setting(0.001, "dense learning rate")
    model: str = setting("auto", "auto = NCF for two tables without dense features, else DLRM", choices=MODELS)
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

    def __post_init__(self) -> None:
        require(self.workers >= 1, f"--workers must be >= 1, got {self.workers}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(0 <= self.eval_fraction < 1, f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        require(self.ps_shards is None or self.ps_shards >= 1, f"--ps-shards must be >= 1, got {self.ps_shards}")
        require(self.epochs >= 1, "--epochs must be >= 1")
        require(self.steps is None or self.steps >= 1, "--steps must be >= 1")
        require(self.workers <= 255, "at most 255 workers per dispatcher")
        require(self.checkpoint_every >= 0, "--checkpoint-every must be >= 0")
        require(self.eval_every >= 1, "--eval-every must be >= 1")
        require(self.max_inflight_steps >= 1, "--max-inflight-steps must be >= 1")
        require(self.timeout_ms >= 1, "--timeout-ms must be >= 1")
        require(self.replicate_below >= 0, "--replicate-below must be >= 0")
        require(self.schedule in SCHEDULES, f"--schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        require(self.consistency in CONSISTENCY_MODES,
                f"--consistency must be one of {CONSISTENCY_MODES}, got {self.consistency!r}")
        require(not (self.replicate_below and self.is_stream),
                "--replicate-below needs the distinct ids of each table from a pre-pass; a kafka:// stream has none")

    @property
    def is_stream(self) -> bool:
        return self.source.startswith("kafka://")

    def tables(self, schema) -> list[TableConfig]:
        """One table config per table of ``schema`` (same dim and sparse optimizer)."""
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
        dense_dim: dense features per sample; model: ``dlrm``/``ncf``/``auto``; seed:
            seed of the dense model (equal replicas on every rank).
        dense_optimizer, dense_lr: the dense optimizer (``sgd``/``adagrad``/``adam``).
        ps: PS shard endpoints in shard order; ps_timeout_ms: longest wait for a shard.
        consistency: the consistency protocol (NOTE [step protocol]; ``bsp``).
        run_dir: where workers write their dense replicas at the end (None: nowhere).
        dist_init: torch.distributed init method (None: ``env://`` under torchrun).
        resume_dense: checkpoint folder whose ``dense.pt`` the workers load, or None.
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

    def __post_init__(self) -> None:
        require(len(self.tables) >= 1 and all(isinstance(t, TableConfig) for t in self.tables),
                "a job needs at least one TableConfig")
        require(len(self.ps) >= 1, "a job needs at least one PS shard endpoint")
        require(self.dense_dim >= 0, f"dense_dim must be >= 0, got {self.dense_dim}")
        require(self.model in MODELS, f"model must be one of {MODELS}, got {self.model!r}")
        require(self.dense_optimizer in DENSE_OPTIMIZERS,
                f"dense optimizer must be one of {DENSE_OPTIMIZERS}, got {self.dense_optimizer!r}")
        require(self.consistency in CONSISTENCY_MODES,
                f"consistency must be one of {CONSISTENCY_MODES}, got {self.consistency!r}")
        require(self.ps_timeout_ms >= 1 and self.capacity_rows >= 0 and self.replica_rows >= 0,
                "ps_timeout_ms must be >= 1, capacity_rows and replica_rows >= 0")
        require(all(0 <= t < len(self.tables) for t in self.replicated_tables),
                f"replicated_tables {self.replicated_tables} must index the {len(self.tables)} tables")

    @classmethod
    def build(cls, cfg: TrainConfig, data: "JobData", ps_addresses: list[str]) -> "JobSpec":
        """The spec of the job ``cfg`` reading ``data``, served by the PS at ``ps_addresses``."""
        return cls(tables=tuple(cfg.tables(data.schema)), dense_dim=data.schema.dense_dim, ps=tuple(ps_addresses),
                   model=cfg.model, seed=cfg.seed, dense_optimizer=cfg.dense_optimizer, dense_lr=cfg.dense_lr,
                   ps_timeout_ms=cfg.timeout_ms, consistency=cfg.consistency,
                   run_dir=str(pathlib.Path(cfg.run_dir).resolve()),
                   replicated_tables=tuple(data.replicated), replica_rows=data.replica_rows)

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
