"""The versioned contract every process of a job agrees on: :class:`JobSpec`.

Sent by the dispatcher to each worker in its ``config`` message (NOTE [dispatch
protocol] in herald/dispatch/peers.py); read by the worker runtime, the report and the
single-process reference trainer. :meth:`JobSpec.build` derives it from a
:class:`~herald.contracts.train.TrainConfig` and the job's data.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

from herald.config import from_mapping, require
from herald.contracts.comm import CommSettings, GroupSettings
from herald.contracts.consistency import ModeContext, ModeSettings, Straggler
from herald.contracts.features import FeatureConfig
from herald.contracts.flags import flag_errors
from herald.contracts.models import check_model
from herald.contracts.modes import BspSettings, check_mode, mode_from_dict
from herald.contracts.tables import TableConfig
from herald.contracts.train import TrainConfig, auto_model
from herald.contracts.vocab import DENSE_OPTIMIZERS, MODELS
from herald.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What every process of a job must agree on: sent by the dispatcher to each worker
    in its ``config`` message (NOTE [dispatch protocol]) as :meth:`to_dict`, read by
    the worker runtime, the report and the single-process reference trainer.

    Attributes:
        tables: the embedding tables (dim, sparse optimizer), in table order.
        features: the source's sparse features, in source order: the table each reads and its
            pooling (NOTE [tables and features] in herald/contracts/features.py); empty: one
            sum-pooled feature per table, in table order (what :attr:`feature_list` gives then).
        dense_dim: dense features per sample; model: one of :data:`MODELS` (``auto``
            resolved by :meth:`build`: :func:`auto_model`); seed:
            seed of the dense model (equal replicas on every rank).
        dense_optimizer, dense_lr: the dense optimizer (``sgd``/``adagrad``/``adam``).
        ps: PS shard endpoints in shard order; timeout_ms: longest wait for any peer (a PS
            shard, the dispatcher) in milliseconds: the job's ``--timeout-ms``.
        mode: the consistency mode's settings (a :class:`~herald.contracts.consistency.ModeSettings`
            of :mod:`herald.contracts.modes`, its name :attr:`consistency`; docs/consistency.md),
            their defaults resolved for the job (GBA's M: NOTE [gba tokens]).
        straggler: straggler injection (``--slow-worker``): that rank sleeps that many ms
            once per step (:class:`~herald.contracts.consistency.Straggler`, rank -1: none).
        comm, groups: wire compression and hierarchical training groups, as the job's
            ``TrainConfig`` has them (:class:`~herald.contracts.comm.CommSettings`,
            :class:`~herald.contracts.comm.GroupSettings`; docs/compression.md).
        group_index: -1: one dispatcher serves every rank; ``g`` >= 0: this job's dispatcher
            serves only group ``g``'s ranks, as its ranks 0..k-1 (NOTE [independent groups]
            in herald/job/group_dispatch.py; the worker's torch.distributed rank is ``g * k + r``).
        run_dir: where workers write their dense replicas at the end (None: nowhere).
        dist_init: torch.distributed init method (None: ``env://`` under torchrun).
        resume_dense: checkpoint folder whose ``dense.pt`` the workers load, or None.
        resume_caches: the workers also load their caches from that folder (a checkpoint off
            the checkpoint grid: NOTE [warm resume] in herald/dispatch/warm.py); set by the dispatcher.
        keys_dir: the CURVE keys folder of the job's PS shards (NOTE [transport security]
            in herald/auth.py), or None. Only the path travels: every host reads the
            keys from its own copy of the folder; a worker's own ``--keys`` wins.
        replicated_tables, replica_rows: NOTE [replicated tables] (herald/worker/replicas.py).
        capacity_rows, num_workers: set by the dispatcher (cache rows per worker, ranks).

    Raises:
        ConfigError: from :meth:`from_dict`: another version, an unknown key, or a bad value.
    """

    #: 2: ps_timeout_ms became timeout_ms (the name TrainConfig gives it); 3: the mode's settings,
    #: the straggler, compression and groups nest (``mode``, ``straggler``, ``comm``, ``groups``);
    #: 4: ``features`` (NOTE [tables and features] in herald/contracts/features.py)
    VERSION = 4
    #: The nested settings of the wire form other than ``mode``: field -> class.
    NESTED = {"straggler": Straggler, "comm": CommSettings, "groups": GroupSettings}

    tables: tuple[TableConfig, ...]
    dense_dim: int
    ps: tuple[str, ...]
    model: str = "auto"
    seed: int = 0
    dense_optimizer: str = "sgd"
    dense_lr: float = 0.01
    timeout_ms: int = 30_000
    mode: ModeSettings = BspSettings()
    run_dir: str | None = None
    dist_init: str | None = None
    resume_dense: str | None = None
    resume_caches: bool = False
    replicated_tables: tuple[int, ...] = ()
    replica_rows: int = 0
    capacity_rows: int = 0
    num_workers: int = 0
    keys_dir: str | None = None
    straggler: Straggler = Straggler()
    comm: CommSettings = CommSettings()
    groups: GroupSettings = GroupSettings()
    group_index: int = -1
    features: tuple[FeatureConfig, ...] = ()

    def __post_init__(self) -> None:
        require(
            len(self.tables) >= 1 and all(isinstance(t, TableConfig) for t in self.tables),
            "a job needs at least one TableConfig",
        )
        require(len(self.ps) >= 1, "a job needs at least one PS shard endpoint")
        require(self.dense_dim >= 0, f"dense_dim must be >= 0, got {self.dense_dim}")
        require(self.model in MODELS, f"model must be one of {MODELS}, got {self.model!r}")
        self._check_features()
        check_model(self.model, self.num_features, min(t.dim for t in self.tables), features=self.feature_list)
        require(
            self.dense_optimizer in DENSE_OPTIMIZERS,
            f"dense optimizer must be one of {DENSE_OPTIMIZERS}, got {self.dense_optimizer!r}",
        )
        check_mode(self.mode, ModeContext(replicated=bool(self.replicated_tables)))
        for name, kind in self.NESTED.items():
            value = getattr(self, name)
            require(isinstance(value, kind), f"{name} must be a {kind.__name__}, got {value!r}")
        require(
            self.timeout_ms >= 1 and self.capacity_rows >= 0 and self.replica_rows >= 0,
            "timeout_ms must be >= 1, capacity_rows and replica_rows >= 0",
        )
        require(
            all(0 <= t < len(self.tables) for t in self.replicated_tables),
            f"replicated_tables {self.replicated_tables} must index the {len(self.tables)} tables",
        )
        require(
            type(self.resume_caches) is bool and (self.resume_dense is not None or not self.resume_caches),
            f"resume_caches must be a bool, true only with resume_dense (got {self.resume_caches!r})",
        )
        require(
            self.keys_dir is None or isinstance(self.keys_dir, str),
            f"keys_dir must be a path or None, got {type(self.keys_dir).__name__}",
        )
        require(
            type(self.group_index) is int and -1 <= self.group_index < self.groups.count,
            f"group_index must be -1 or a group below groups {self.groups.count}, got {self.group_index!r}",
        )

    @classmethod
    def build(cls, cfg: TrainConfig, data: Any, ps_addresses: list[str]) -> JobSpec:
        """The spec of the job ``cfg`` reading ``data`` (a :class:`herald.job.data.JobData`: its
        ``schema``, ``dataset``, ``replicated`` and ``replica_rows`` are read), served by the PS
        at ``ps_addresses``."""
        tables, features = cfg.layout(data.schema)
        with flag_errors():
            return cls(
                tables=tuple(tables),
                features=tuple(features),
                dense_dim=data.schema.dense_dim,
                ps=tuple(ps_addresses),
                model=auto_model(cfg.model, data.dataset, data.schema.num_tables, data.schema.dense_dim),
                seed=cfg.seed,
                dense_optimizer=cfg.dense.optimizer,
                dense_lr=cfg.dense.lr,
                timeout_ms=cfg.timeout_ms,
                mode=cfg.mode.for_job(cfg.mode_context),
                run_dir=str(pathlib.Path(cfg.run_dir).resolve()),
                replicated_tables=tuple(data.replicated),
                replica_rows=data.replica_rows,
                keys_dir=str(pathlib.Path(cfg.security.keys_dir).resolve()) if cfg.security.keys_dir else None,
                comm=cfg.comm,
                groups=cfg.groups,
                straggler=cfg.straggler,
            )

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-able dict with a ``version`` key (inverse: :meth:`from_dict`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(
            version=self.VERSION,
            tables=[t.to_dict() for t in self.tables],
            features=[f.to_dict() for f in self.features],
            ps=list(self.ps),
            replicated_tables=list(self.replicated_tables),
            mode=self.mode.to_dict(),
            **{name: dataclasses.asdict(getattr(self, name)) for name in self.NESTED},
        )
        return out

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> JobSpec:
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigError: not a mapping, another version, an unknown key, or a bad value.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"a job spec must be a mapping, got {type(mapping).__name__}")
        values = dict(mapping)
        version = values.pop("version", None)
        if version != cls.VERSION:
            raise ConfigError(
                f"job spec version {version!r} is not {cls.VERSION}: run the same herald version "
                "on the dispatcher and every worker"
            )
        try:
            values["tables"] = tuple(TableConfig.from_dict(t) for t in values.get("tables", ()))
            values["features"] = tuple(
                from_mapping(FeatureConfig, f, where="job spec feature") for f in values.get("features", ())
            )
            values["ps"] = tuple(values.get("ps", ()))
            values["replicated_tables"] = tuple(int(t) for t in values.get("replicated_tables", ()))
            if "mode" in values:
                values["mode"] = mode_from_dict(values["mode"])
            for name, kind in cls.NESTED.items():
                if name in values:
                    values[name] = from_mapping(kind, values[name], where=f"job spec {name}")
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed job spec: {exc}") from None
        return from_mapping(cls, values, where="job spec")

    @property
    def max_dim(self) -> int:
        """The widest table's dim: the worker's rows and gradients are padded to it (NOTE
        [mixed widths] in herald/ps/router.py)."""
        return max(t.dim for t in self.tables)

    @property
    def max_row_width(self) -> int:
        """The widest table's row (embedding and optimizer state): the worker cache's width."""
        return max(t.row_width for t in self.tables)

    @property
    def mixed_widths(self) -> bool:
        """The tables differ in dim or row width."""
        return len({(t.dim, t.row_width) for t in self.tables}) > 1

    @property
    def feature_dims(self) -> tuple[int, ...]:
        """The dim of each feature's table (:attr:`feature_list`)."""
        return tuple(self.tables[t].dim for t in self.feature_tables)

    @property
    def feature_list(self) -> tuple[FeatureConfig, ...]:
        """One :class:`FeatureConfig` per feature of the micro-batch (:attr:`features`, or one
        sum-pooled feature per table)."""
        return self.features or tuple(FeatureConfig(name=t.name, table=t.name) for t in self.tables)

    @property
    def num_features(self) -> int:
        """The features ``T`` of every micro-batch (the model's pooled and sequence inputs)."""
        return len(self.features) or len(self.tables)

    @property
    def feature_tables(self) -> tuple[int, ...]:
        """The table index of each feature (:attr:`feature_list`)."""
        index = {t.name: i for i, t in enumerate(self.tables)}
        return tuple(index[f.table] for f in self.feature_list)

    @property
    def shared_feature_tables(self) -> tuple[int, ...] | None:
        """:attr:`feature_tables` where some features share a table, else None (feature t reads table t)."""
        tables = self.feature_tables
        return None if tables == tuple(range(len(self.tables))) else tables

    def _check_features(self) -> None:
        require(
            all(isinstance(f, FeatureConfig) for f in self.features),
            "features must be FeatureConfig objects",
        )
        if not self.features:
            return
        names = [f.name for f in self.features]
        require(len(set(names)) == len(names), f"feature names must be unique, got {names[:40]}")
        tables = [t.name for t in self.tables]
        read = [f.table for f in self.features]
        unknown = sorted(set(read) - set(tables))
        require(not unknown, f"features read table(s) {unknown} the job does not have ({tables[:40]})")
        sequences = [f.name for f in self.features if f.is_sequence]
        require(
            not sequences or self.mode.name != "hybrid",
            f"sequence features {sequences[:10]} need each row's gradient, and hybrid training (Persia §3) "
            "sends the pooled bags' gradients: pool them (sum or mean) or use another --consistency",
        )
        unread = [t for t in tables if t not in read]
        require(not unread, f"table(s) {unread[:10]} are read by no feature")
        require(
            self.shared_feature_tables is None or self.mode.name not in ("hybrid", "gba"),
            f"features sharing a table are trained under bsp and bounded; {self.mode.name} does not share "
            "them yet: give each feature a table of its own, or use --consistency bsp or bounded",
        )
        require(
            not self.mixed_widths or self.mode.name not in ("hybrid", "gba"),
            f"tables of different widths are trained under bsp and bounded; {self.mode.name} needs one "
            "width: give every table the same dim and optimizer, or use --consistency bsp or bounded",
        )

    @property
    def consistency(self) -> str:
        """The consistency mode's name: ``mode.name``."""
        return self.mode.name

    @property
    def dim(self) -> int:
        """The embedding dim shared by every table (the worker cache needs one).

        Raises:
            ConfigError: tables differ in dim or optimizer-state width.
        """
        dims = {(t.dim, t.row_width) for t in self.tables}
        if len(dims) != 1:
            raise ConfigError(
                "the worker cache needs every table to share dim and optimizer state width, got "
                f"{sorted(dims)}; give all tables the same dim and optimizer"
            )
        return next(iter(dims))[0]
