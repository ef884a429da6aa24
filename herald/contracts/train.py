"""The settings of a job as a user gives them: :class:`TrainConfig` (``herald train`` and
``herald serve dispatcher``; their options are generated from it). Validated on
construction, naming the flag.

Imports no numba/torch/zmq package, so that ``herald train`` checks its options in well
under a second, before anything starts (herald/cli.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from herald.config import Nested, flags_of, from_flags, key_value, nested, parse_value, require, setting
from herald.contracts.comm import CommSettings, GroupSettings
from herald.contracts.consistency import ModeContext, ModeSettings, Straggler
from herald.contracts.features import MAX_SEQUENCE_LENGTH, FeatureConfig
from herald.contracts.flags import _choice, _flag, _integer, _number, flag_errors
from herald.contracts.models import MIXED_WIDTH_MODELS, MODEL_NEEDS, check_model, mixed_width_error
from herald.contracts.modes import MODE_FLAGS, BspSettings, check_mode, consistency_mode
from herald.contracts.script import ScriptSettings
from herald.contracts.settings import (
    CacheSettings,
    DenseSettings,
    EmbeddingSettings,
    LauncherSettings,
    RecoverySettings,
    SchedulingSettings,
    SecuritySettings,
)
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.vocab import (
    DEFAULT_TIMEOUT_MS,
    DEVICE_PATTERN,
    MAX_BRUTEFORCE_WORKERS,
    MAX_PS_SHARDS,
    MAX_TIMEOUT_MS,
    MAX_WORKERS,
    MODELS,
)
from herald.errors import ConfigError

DEFAULT_SOURCE = "synthetic://criteo?rows=600000&seed=0"
#: ``--model auto`` on a known dataset: Herald's workload table (Herald
#: Table 1: W1 Criteo + Wide&Deep, W2 MovieLens + NCF, W3 Avazu + DeepFM), keyed by the
#: source's format. Other sources (synthetic, Parquet, libFM, Kafka) keep the shape rule
#: of :func:`auto_model`, so the synthetic default still trains DLRM.
WORKLOAD_MODELS = {"criteo": "wdl", "movielens": "ncf", "avazu": "deepfm"}
#: NOTE [din layout]. ``--model din`` without ``--tables`` on a source whose features are
#: MovieLens's side features (``user, item, genres, history``: a ratings file opened with
#: ``side_features=True``, which din turns on for a MovieLens source, or such a file converted
#: to Parquet) lays them out itself: ``history`` is a sequence (pooling ``none``) of the last
#: ``L`` movies reading ``item``'s table (one key space: a behaviour and the target item are
#: the same kind of id and share their embeddings, as in DIN, Zhou et al., KDD'18), ``genres`` is
#: mean-pooled, the others keep their own tables, sum-pooled. ``L`` is
#: ``--source-option history=L`` (default :data:`DIN_HISTORY_LENGTH`), passed to the source as
#: ``history_length=L`` (the source keeps the most recent L) and used as the feature's
#: ``max_length``. A ``--tables`` file wins over this layout; any other source needs one that
#: declares a sequence feature (:func:`herald.contracts.models.check_model` says how).
DIN_HISTORY_LENGTH = 20
#: The features NOTE [din layout] reads: the target, the sequence, the mean-pooled bag.
DIN_TARGET, DIN_SEQUENCE, DIN_MEAN = "item", "history", "genres"


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
        ``WORKLOAD_MODELS[dataset]`` for a known dataset (Herald's workloads) when its tables
        fit that model, else ``ncf`` for two tables without dense features, else ``dlrm``.
    """
    if model != "auto":
        return model
    if dataset in WORKLOAD_MODELS and MODEL_NEEDS[WORKLOAD_MODELS[dataset]].tables in (None, num_tables):
        return WORKLOAD_MODELS[dataset]  # (MovieLens with its side features has more tables than NCF reads)
    return "ncf" if num_tables == 2 and dense_dim == 0 else "dlrm"


def din_history_length(source_options: tuple[tuple[str, Any], ...]) -> int:
    """``L`` of NOTE [din layout] from ``--source-option`` pairs: ``history=L``, else the
    source's ``history_length``, else :data:`DIN_HISTORY_LENGTH`.

    Raises:
        ConfigError: ``L`` not an int in 1..MAX_SEQUENCE_LENGTH.
    """
    options = dict(source_options)
    length = options.get("history", options.get("history_length", DIN_HISTORY_LENGTH))
    require(
        isinstance(length, int) and not isinstance(length, bool) and 1 <= length <= MAX_SEQUENCE_LENGTH,
        f"--source-option history=L needs an int L in 1..{MAX_SEQUENCE_LENGTH}, got {length!r:.40}",
    )
    return length


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one ``herald train`` job; each setting is an option (``herald train --help``):
    a field is ``--field-name``, a nested group's settings keep their flat flags
    (``cfg.cache.rows`` is ``--cache-rows``: :mod:`herald.contracts.settings`,
    :mod:`herald.contracts.comm`; the mode's, ``cfg.mode``, :mod:`herald.contracts.modes`).
    Build one from flags with :meth:`from_flags`. Validated on construction, naming the flag.

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
    scheduling: SchedulingSettings = nested(SchedulingSettings)  # --schedule, --scheduling-budget, ...
    mode: ModeSettings = nested(BspSettings, flags=MODE_FLAGS)  # --consistency and its mode's options
    slow_worker: str | None = setting(
        None, "straggler injection for experiments: worker RANK sleeps MS milliseconds once per step", metavar="RANK:MS"
    )
    comm: CommSettings = nested(CommSettings)  # --wire-dtype, --dense-comm
    groups: GroupSettings = nested(GroupSettings)  # --groups, --average-every, --easgd-alpha
    workers: int = setting(2, "number of workers")
    batch_size: int = setting(128, "samples per worker per step; global batch = workers x batch size")
    cache: CacheSettings = nested(CacheSettings, prefix="cache_")  # --cache-ratio, --cache-rows, ...
    embedding: EmbeddingSettings = nested(EmbeddingSettings)  # --embedding-dim, --optimizer, --lr
    dense: DenseSettings = nested(DenseSettings, prefix="dense_")  # --dense-optimizer, --dense-lr
    model: str = setting(
        "auto",
        "dlrm, wdl (Wide&Deep), deepfm, dcn (DCN v2), ncf or din (DIN: attention over a history "
        "sequence; on MovieLens it turns on the side features, --source-option history=L, default 20); "
        "auto = the Herald workload "
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
    recovery: RecoverySettings = nested(RecoverySettings)  # --ps-restarts, --worker-restarts
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
    pin_cores: bool = setting(
        False,
        "pin each process of the job (every worker, every PS shard, this process with "
        "its dispatcher) to cores of its own, so that they do not share a core: the cores "
        "this process may use split evenly, each worker's torch threads one per core "
        "(unless OMP_NUM_THREADS is set); with more processes than cores, one core each, "
        "round-robin (said in the log) (Linux)",
    )
    security: SecuritySettings = nested(SecuritySettings)  # --keys, --insecure
    launcher: LauncherSettings = nested(LauncherSettings)  # --launcher, --ray-address, --storage-path
    script: ScriptSettings = nested(ScriptSettings)  # --script FILE [-- ARGS]: the user's own worker loop

    def __post_init__(self) -> None:
        """Check every setting before any process starts, naming the flag: each nested group
        checked itself on construction; here the others, and those across groups."""
        for f in dataclasses.fields(self):
            group = f.metadata.get("nested")
            if isinstance(group, Nested):
                value = getattr(self, f.name)
                require(isinstance(value, group.cls), f"{f.name} must be a {group.cls.__name__}, got {value!r}")
        self._check_source()
        self._check_values()
        Straggler.parse(self.slow_worker, self.workers)
        self.groups.check(self.workers)
        self.recovery.check(self.checkpoint_every)
        check_mode(self.mode, self.mode_context)
        check_model(self.model, None, self.embedding.dim)  # the tables: check_schema, once the source is open
        require(
            self.model == "din" or "history" not in dict(self.source_options),
            "--source-option history=L is the history length of --model din (NOTE [din layout]); for another "
            "model give the MovieLens source history_length=L (with side_features=true)",
        )
        if self.model == "din":
            din_history_length(self.source_options)  # --source-option history=L checked before the source opens
        require(
            self.scheduling.schedule != "optimal" or (self.batch_size == 1 and self.workers <= MAX_BRUTEFORCE_WORKERS),
            f"--schedule optimal (brute force) needs --batch-size 1 and --workers <= {MAX_BRUTEFORCE_WORKERS}, got "
            f"--batch-size {self.batch_size} --workers {self.workers}",
        )
        require(
            not (self.replicate_below and self.is_stream),
            "--replicate-below needs the distinct ids of each table from a pre-pass; a kafka:// stream has none",
        )
        # frozen: the run folder normalised once, on construction (STORAGE_PATH/RUN_DIR under Ray)
        object.__setattr__(self, "run_dir", self.launcher.check(self.device, self.pin_cores, self.run_dir))

    def _check_source(self) -> None:
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

    def _check_values(self) -> None:
        """The settings of no group, each alone."""
        _choice(self, "model", MODELS)
        _integer(self, "workers", 1, MAX_WORKERS)
        _integer(self, "batch_size", 1)
        _integer(self, "epochs", 1)
        _integer(self, "steps", 1, optional=True)
        _integer(self, "ps_shards", 1, MAX_PS_SHARDS, optional=True)
        _integer(self, "seed", 0, 2**63 - 1)
        _integer(self, "max_inflight_steps", 1, optional=True)
        _integer(self, "timeout_ms", 100, MAX_TIMEOUT_MS)
        _integer(self, "ps_max_rows", 0)
        _integer(self, "checkpoint_every", 0)
        _integer(self, "eval_every", 1)
        _integer(self, "replicate_below", 0)
        _number(self, "eval_fraction", "in [0, 1)", lambda x: 0 <= x < 1)
        require(
            isinstance(self.device, str) and re.fullmatch(DEVICE_PATTERN, self.device) is not None,
            f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        require(
            isinstance(self.run_dir, str) and self.run_dir.strip() != "",
            f"--run-dir must be a folder path, got {self.run_dir!r}",
        )
        for name in ("resume", "log_sample_ids", "pin_cores"):
            require(
                isinstance(getattr(self, name), bool),
                f"{_flag(name)} is a switch (True/False), got {getattr(self, name)!r}",
            )
        require(
            not self.pin_cores or hasattr(os, "sched_setaffinity"),
            "--pin-cores needs os.sched_setaffinity (Linux); leave it out on this system",
        )

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
            groups=self.groups.count,
            resume=self.resume,
            checkpoint_every=self.checkpoint_every,
        )

    @property
    def is_stream(self) -> bool:
        return self.source.startswith("kafka://")

    @property
    def din_history_length(self) -> int:
        """``L`` of NOTE [din layout]: ``--source-option history=L``, else the source's
        ``history_length``, else :data:`DIN_HISTORY_LENGTH`.

        Raises:
            ConfigError: ``L`` not an int in 1..MAX_SEQUENCE_LENGTH.
        """
        return din_history_length(self.source_options)

    def source_options_for(self, dataset: str | None) -> dict[str, Any]:
        """The options the source is opened with: ``--source-option``'s, and for ``--model din``
        on MovieLens (``dataset``, the source's format name) ``side_features=True`` (unless given)
        and ``history_length=L`` (NOTE [din layout]); ``history`` itself is not the source's.

        Raises:
            ConfigError: ``history=L`` for a source that is not MovieLens (nothing would read it).
        """
        options = dict(self.source_options)
        if self.model != "din":
            return options
        history = options.pop("history", None)
        if dataset == "movielens":
            options.setdefault("side_features", True)
            options["history_length"] = self.din_history_length
        elif history is not None:
            raise ConfigError(
                f"--source-option history={history} sets the history of --model din on a MovieLens ratings "
                f"file; this source ({dataset or self.source}) has none: declare your sequence feature's "
                "max_length with --tables FILE instead"
            )
        return options

    def tables(self, schema) -> list[TableConfig]:
        """The job's tables: those of the ``--tables`` file and one per feature it does not
        name (NOTE [tables and features] in herald/contracts/features.py); without a file one
        per feature of ``schema``, all at ``--embedding-dim`` with ``--optimizer`` / ``--lr``.

        Args:
            schema: a :class:`herald.loader.batch.Schema` (its ``table_names``, the features, are read).

        Raises:
            ConfigError: worded with the flags (:func:`flag_errors`); declarations the source refuses.
        """
        return self.layout(schema)[0]

    def features(self, schema) -> list[FeatureConfig]:
        """One :class:`~herald.contracts.features.FeatureConfig` per feature of ``schema`` (:meth:`tables`)."""
        return self.layout(schema)[1]

    def layout(self, schema) -> tuple[list[TableConfig], list[FeatureConfig]]:
        """``(tables, features)`` of :meth:`tables` and :meth:`features`."""
        e = self.embedding
        with flag_errors():
            if e.tables_file is None:
                opt = OptimizerConfig(name=e.optimizer, lr=e.lr)
                names = schema.table_names
                features = [FeatureConfig(name=n, table=n) for n in names]
                if self.model == "din" and DIN_TARGET in names and DIN_SEQUENCE in names:
                    features = [self._din_feature(n) for n in names]
                tables = list(dict.fromkeys(f.table for f in features))
                return [TableConfig(name=n, dim=e.dim, optimizer=opt) for n in tables], features
            try:
                return e.declarations().resolve(schema.table_names, e.dim, e.optimizer, e.lr)
            except ConfigError as exc:
                raise ConfigError(f"--tables {e.tables_file}: {exc}") from None

    def _din_feature(self, name: str) -> FeatureConfig:
        """Feature ``name`` of NOTE [din layout]."""
        if name == DIN_SEQUENCE:
            return FeatureConfig(name=name, table=DIN_TARGET, pooling="none", max_length=self.din_history_length)
        return FeatureConfig(name=name, table=name, pooling="mean" if name == DIN_MEAN else "sum")

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
        tables, features = self.layout(schema)
        widths = sorted({t.dim for t in tables})
        where = f"--tables {self.embedding.tables_file}"
        shapes = {(t.dim, t.row_width) for t in tables}
        require(  # the model sees the dims (the optimizer state stays in the rows)
            len(widths) == 1 or self.script.path is not None or model in MIXED_WIDTH_MODELS,
            f"{where}: {mixed_width_error(model)}",
        )
        require(
            len(shapes) == 1 or self.mode.name not in ("hybrid", "gba"),
            f"{where}: tables of different widths are trained under --consistency bsp and bounded, not "
            f"{self.mode.name}: give every table the same dim and optimizer",
        )
        sequences = [f.name for f in features if f.is_sequence]
        require(
            not sequences or self.script.path is not None or (model in MODEL_NEEDS and MODEL_NEEDS[model].sequence),
            f'{where}: the sequence feature(s) {sequences[:10]} (pooling "none") need a model that reads '
            "sequences, which of --model's only din does: choose --model din (one sequence and its target), train "
            "your own with --script (ScheduledLoader.embedding('features') gives padded sequences), or pool them "
            "(sum or mean)",
        )
        if self.script.path is not None:  # the script brings its own model: --model is not trained
            return
        check_model(
            model,
            schema.num_tables,
            widths[0],
            chosen_as=self.model,
            table_names=tuple(schema.table_names),
            features=features,
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
