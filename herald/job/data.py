"""What a job reads: schema, global batches, held-out split, replicated tables, and the
cache size of its schedulers (shared by ``herald train`` and ``herald serve dispatcher``)."""

from __future__ import annotations

from herald.contracts.settings import STREAM_CACHE_ROWS
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.loader import open_source, splits
from herald.loader.global_batches import GlobalBatches, KafkaRecords
from herald.loader.registry import infer_format
from herald.scheduler import Scheduler, SchedulerConfig
from herald.scheduler.budget import BudgetController
from herald.scheduler.parallel import check_threads


class JobData:
    """What a job reads: schema, global batches (one :class:`GlobalBatches` producer for
    every source; its state is part of the dispatcher's, so checkpoints resume it),
    held-out split, replicated tables, the cache size of its schedulers, and (Kafka)
    position and commit.

    ``dataset`` is the source's format name (``criteo``, ``avazu``, ``movielens``,
    ``synthetic``, ...): ``--model auto`` trains that dataset's Herald workload model
    (:func:`herald.contracts.train.auto_model`).

    The settings that need the source's schema (:meth:`TrainConfig.check_schema`: the
    model against the tables and ``--embedding-dim``) are checked as soon as the schema is
    known: before the row count and the distinct-key pre-pass (passes over the whole
    input) and before the job runner starts any process.

    Raises:
        ConfigError: a setting the source's schema refuses (named by its flag), or a training
            split shorter than one global batch.
    """

    def __init__(self, cfg: TrainConfig, dispatcher_rank: int = 0):
        self._scheduling = None  # (SchedulerConfig, BudgetController or None): scheduler_factory()
        self.dataset = dict(cfg.source_options).get("format") or infer_format(cfg.source)
        options = cfg.source_options_for(self.dataset)  # --model din on MovieLens: NOTE [din layout]
        self.source = None
        if cfg.is_stream:
            self.source = open_source(cfg.source, **options)
            if hasattr(self.source, "outage"):  # NOTE [kafka outage]: how a job lost with its broker goes on
                self.source.outage.resume_hint = (
                    f"start the broker again, then run this job's command with --resume (run folder {cfg.run_dir}): "
                    "it continues from the latest checkpoint there, whose position is at or after these offsets"
                )
            self.schema = self.source.schema
            try:
                cfg.check_schema(self.schema, self.dataset)
                self._layout(cfg)
            except BaseException:
                self.source.close()
                raise
            # prefetch_batches=0: kafka-python's consumer is not thread-safe, and the
            # checkpoint commits through it from the dispatcher's thread
            self.batches = GlobalBatches(
                self.source,
                cfg.global_batch,
                max_steps=cfg.steps,
                tracker=KafkaRecords(dispatcher_rank),
                prefetch_batches=0,
            )
            self.eval_source, self.distinct_keys = None, None
            self.replicated, self.replica_rows = [], 0
            self.split_info = {"total_rows": None, "train_rows": None, "eval_rows": 0}
            return
        cfg.check_schema(splits.source_schema(cfg.source, options), self.dataset)
        train, self.eval_source, self.split_info = splits.open_train_eval(cfg.source, cfg.eval_fraction, options)
        rows = self.split_info["train_rows"]
        if rows is not None and rows < cfg.global_batch:  # no step to train: say so before any process starts
            for source in (train, self.eval_source):
                if source is not None and hasattr(source, "close"):
                    source.close()
            raise ConfigError(
                f"--source {cfg.source}: its training split has {rows} rows, fewer than one global batch "
                f"(--workers {cfg.workers} x --batch-size {cfg.batch_size} = {cfg.global_batch}): lower "
                f"--batch-size or --workers, or lower --eval-fraction ({cfg.eval_fraction}) or give more rows"
            )
        self.schema = train.schema
        self._layout(cfg)
        self.batches = GlobalBatches(train, cfg.global_batch, epochs=cfg.epochs, max_steps=cfg.steps)
        self.replicated, self.replica_rows, self.distinct_keys = [], 0, None
        if cfg.cache.rows is None or cfg.replicate_below:
            per_feature = splits.distinct_keys_per_table(cfg.source, options, self.split_info["train_rows"])
            # a table's distinct keys, at most the sum of its features' (NOTE [tables and features])
            per_table = [0] * self.num_tables
            for f, n in enumerate(per_feature):
                per_table[self.feature_tables[f]] += n
            # NOTE [replicated tables] (herald/worker/replicas.py): small tables live on every worker
            self.replicated = [t for t, n in enumerate(per_table) if n <= cfg.replicate_below]
            self.replica_rows = sum(per_table[t] for t in self.replicated)
            self.distinct_keys = max(1, sum(n for t, n in enumerate(per_table) if t not in self.replicated))

    def _layout(self, cfg: TrainConfig) -> None:
        """The job's tables and the table of each feature (NOTE [tables and features])."""
        tables, features = cfg.layout(self.schema)
        index = {t.name: i for i, t in enumerate(tables)}
        self.num_tables = len(tables)
        self.feature_tables = tuple(index[f.table] for f in features)

    def scheduler_factory(self, cfg: TrainConfig):
        """A callable returning a fresh :class:`Scheduler` for this job (the dispatcher
        makes one at the start and one after every checkpoint barrier).

        With ``--scheduling-budget`` (adaptive LAIA, Herald §4.3) all of them share one
        :class:`herald.scheduler.budget.BudgetController`, so k, the measured step period
        and k's history span the job (:meth:`scheduler_stats`). ``--scheduler-threads``
        is checked here, before any process starts.

        Raises:
            ConfigError: more scheduler threads than numba's pool.
        """
        cache_rows = cfg.cache.rows if cfg.cache.rows or not cfg.is_stream else STREAM_CACHE_ROWS
        sched_cfg = SchedulerConfig(
            num_workers=cfg.workers,
            batch_size_per_worker=cfg.batch_size,
            schedule=cfg.scheduling.schedule,
            cache_policy=cfg.cache.policy,
            cache_capacity_rows=cache_rows,
            cache_ratio=cfg.cache.ratio,
            seed=cfg.seed,
            scheduling_budget_ms=cfg.scheduling.budget,
            threads=cfg.scheduling.threads,
        )
        check_threads(sched_cfg.threads)
        num_tables, distinct = self.num_tables, self.distinct_keys
        feature_tables = None if self.feature_tables == tuple(range(num_tables)) else self.feature_tables
        budget = (
            BudgetController(num_tables, sched_cfg.scheduling_budget_ms, fraction=sched_cfg.auto_budget_fraction)
            if sched_cfg.scheduling_budget_ms is not None
            else None
        )
        self._scheduling = (sched_cfg, budget)
        return lambda: Scheduler(
            sched_cfg, num_tables=num_tables, distinct_keys=distinct, budget=budget, feature_tables=feature_tables
        )

    def scheduler_stats(self) -> dict | None:
        """The job's scheduler settings and adaptive LAIA's k over the job, for the report:
        ``{"threads", "lock_free_allocation", "adaptive": BudgetController.stats() or
        None}``; None before :meth:`scheduler_factory`."""
        if self._scheduling is None:
            return None
        sched_cfg, budget = self._scheduling
        return {
            "threads": sched_cfg.threads,
            "lock_free_allocation": sched_cfg.lock_free_allocation,
            "adaptive": budget.stats() if budget is not None else None,
        }

    def total_steps(self, cfg: TrainConfig) -> int | None:
        """Steps the job will train, when known (None for an unbounded stream)."""
        rows = self.split_info["train_rows"]
        steps = None if rows is None else (rows // cfg.global_batch) * cfg.epochs
        if cfg.steps is not None:
            steps = cfg.steps if steps is None else min(steps, cfg.steps)
        return steps

    def position(self, batch_index: int):
        """JSON-able source position after batch ``batch_index`` (Kafka), else None."""
        position = self.batches.position(batch_index)
        return None if position is None else position.to_dict()

    def commit(self, batch_index: int) -> None:
        """Commit the position after batch ``batch_index`` (Kafka; NOTE [kafka delivery])."""
        if self.source is not None:
            self.source.commit(self.batches.position(batch_index))
        self.batches.release(batch_index)

    def interrupt(self) -> None:
        """Make a blocked Kafka read return (thread-safe; files need nothing)."""
        if self.source is not None:
            self.source.interrupt()

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the producer and its source within ``timeout_s`` (the eval source is closed by the evaluation)."""
        self.batches.close(timeout_s)
