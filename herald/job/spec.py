"""The settings of a job: :class:`TrainConfig` (what ``herald train`` is given) and the
job dict every worker receives (:func:`build_job`)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING, Any

from herald.config import require
from herald.ps import OptimizerConfig, TableConfig

if TYPE_CHECKING:
    from herald.job.data import JobData

DEFAULT_SOURCE = "synthetic://criteo?rows=600000&seed=0"
#: Worker cache rows for a kafka:// stream without --cache-rows: a stream has no known
#: set of keys to take --cache-ratio of.
STREAM_CACHE_ROWS = 100_000


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one ``herald train`` job (see ``herald train --help``)."""

    source: str = DEFAULT_SOURCE
    schedule: str = "herald"
    workers: int = 2
    batch_size: int = 128
    cache_ratio: float = 0.1
    cache_rows: int | None = None
    cache_policy: str = "lru"
    embedding_dim: int = 16
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.05
    dense_optimizer: str = "adam"
    dense_lr: float = 0.001
    model: str = "auto"
    epochs: int = 1
    steps: int | None = None
    eval_fraction: float = 0.1
    ps_shards: int = 1
    seed: int = 0
    run_dir: str = "runs/latest"
    max_inflight_steps: int = 2
    timeout_ms: int = 120_000
    checkpoint_every: int = 0
    resume: bool = False
    eval_every: int = 100
    log_sample_ids: bool = False
    replicate_below: int = 0
    source_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        require(self.workers >= 1, f"--workers must be >= 1, got {self.workers}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(0 <= self.eval_fraction < 1, f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        require(self.ps_shards >= 1, "--ps-shards must be >= 1")
        require(self.epochs >= 1, "--epochs must be >= 1")
        require(self.steps is None or self.steps >= 1, "--steps must be >= 1")
        require(self.workers <= 255, "at most 255 workers per dispatcher")
        require(self.checkpoint_every >= 0, "--checkpoint-every must be >= 0")
        require(self.eval_every >= 1, "--eval-every must be >= 1")
        require(self.replicate_below >= 0, "--replicate-below must be >= 0")
        require(not (self.replicate_below and self.is_stream),
                "--replicate-below needs the distinct ids of each table from a pre-pass; a kafka:// stream has none")
        require(not self.resume or self.is_stream,
                "--resume continues a kafka:// stream from its latest checkpoint; file sources are re-run")

    @property
    def is_stream(self) -> bool:
        return self.source.startswith("kafka://")

    def tables(self, schema) -> list[TableConfig]:
        """One table config per table of ``schema`` (same dim and sparse optimizer)."""
        opt = OptimizerConfig(name=self.optimizer, lr=self.lr)
        return [TableConfig(name=n, dim=self.embedding_dim, optimizer=opt) for n in schema.table_names]

    @property
    def global_batch(self) -> int:
        return self.workers * self.batch_size


def build_job(cfg: TrainConfig, data: "JobData", ps_addresses: list[str]) -> dict[str, Any]:
    """The job dict every worker receives in the dispatcher's config message."""
    job = {
        "tables": [t.to_dict() for t in cfg.tables(data.schema)],
        "table_names": list(data.schema.table_names),
        "dense_dim": data.schema.dense_dim,
        "model": cfg.model,
        "seed": cfg.seed,
        "dense_optimizer": {"name": cfg.dense_optimizer, "lr": cfg.dense_lr},
        "ps": ps_addresses,
        "run_dir": str(pathlib.Path(cfg.run_dir).resolve()),
        "ps_timeout_ms": cfg.timeout_ms,
    }
    if data.replicated:  # NOTE [replicated tables] (herald/worker/replicas.py)
        job["replicated_tables"], job["replica_rows"] = data.replicated, data.replica_rows
    return job
