"""Tables and features declared apart, as TorchRec's ``EmbeddingBagConfig`` /
``EmbeddingConfig`` do: a *table* is a key space with a width, a sparse optimizer and an
initialiser; a *feature* is a column of the source that reads one table, with its
pooling.

NOTE [tables and features]. A source has features (its sparse columns, in order: the
``table_names`` of its :class:`~herald.loader.batch.Schema`). Without declarations every
feature reads a table of its own, named as the feature, at ``--embedding-dim`` with
``--optimizer`` / ``--lr``: herald's behaviour before declarations, unchanged. A
declaration file (``herald train --tables FILE``, TOML or JSON with the same keys) names
tables and features::

    [tables.ads]            # dim, optimizer, lr, init and init_scale are optional
    dim = 32
    [features.C1]
    table = "ads"
    [features.C2]
    table = "ads"           # C1 and C2 read one table: one key space
    pooling = "mean"        # sum (default) | mean | none (a sequence; needs max_length)

:meth:`Declarations.resolve` turns them and the source's features into the job's tables
(in order of first use along the source's features) and one :class:`FeatureConfig` per
source feature. A source feature the file does not name keeps its own table; a declared
feature the source lacks, a table no feature reads, or a default table whose name a
declared table already has is an error that names the fix.

Pooling (TorchRec's ``PoolingType``): ``sum`` adds a bag's rows; ``mean`` divides that sum
by the bag's length (an empty bag gives zeros); ``none`` keeps the rows in order, a
sequence of at most ``max_length`` rows (the last ``max_length`` of a longer one: a
history ordered oldest first keeps its most recent entries; truncations are counted).

Imports no numba/torch/zmq package (herald/contracts/train.py).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from herald.config import require
from herald.contracts.tables import MAX_TABLE_NAME_CHARS, OptimizerConfig, TableConfig
from herald.contracts.vocab import INITS, MAX_EMBEDDING_DIM, SPARSE_OPTIMIZERS
from herald.errors import ConfigError
from herald.inputs import read_text_file

#: A feature's pooling: TorchRec's ``PoolingType.SUM`` / ``MEAN`` and an unpooled sequence.
POOLINGS = ("sum", "mean", "none")
#: Longest sequence a feature may declare (rows per sample).
MAX_SEQUENCE_LENGTH = 1 << 16


def _name(value: Any, what: str) -> str:
    require(
        isinstance(value, str) and 0 < len(value) <= MAX_TABLE_NAME_CHARS and value.isprintable(),
        f"{what} must be a non-empty printable string of at most {MAX_TABLE_NAME_CHARS} characters, got {value!r:.60}",
    )
    return value


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """One sparse feature of the source and how the model sees it (NOTE [tables and features]).

    Args:
        name: the source's column (a name of its schema's ``table_names``).
        table: the name of the table it reads (several features may read one).
        pooling: ``sum``, ``mean`` or ``none`` (a sequence).
        max_length: rows a sequence keeps (1..:data:`MAX_SEQUENCE_LENGTH`), required with
            ``none``; 0 (the default) otherwise.

    Raises:
        ConfigError: a name, pooling or length out of range.
    """

    name: str
    table: str
    pooling: str = "sum"
    max_length: int = 0

    def __post_init__(self) -> None:
        _name(self.name, "a feature name")
        _name(self.table, f"feature {self.name!r}: its table")
        require(
            isinstance(self.pooling, str) and self.pooling in POOLINGS,
            f"feature {self.name!r}: pooling {self.pooling!r:.40} is unknown; use one of {POOLINGS}",
        )
        length = self.max_length
        require(
            isinstance(length, int) and not isinstance(length, bool),
            f"feature {self.name!r}: max_length must be an int, got {length!r:.40}",
        )
        if self.pooling == "none":
            require(
                1 <= length <= MAX_SEQUENCE_LENGTH,
                f'feature {self.name!r}: pooling "none" (a sequence) needs max_length in '
                f"1..{MAX_SEQUENCE_LENGTH}, got {length}",
            )
        else:
            require(
                length == 0,
                f'feature {self.name!r}: max_length is for sequences (pooling "none"), not {self.pooling!r}',
            )

    @property
    def is_sequence(self) -> bool:
        return self.pooling == "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The keys a table declaration may hold; what is left out comes from the job's flags.
TABLE_KEYS = ("dim", "optimizer", "lr", "init", "init_scale")
FEATURE_KEYS = ("table", "pooling", "max_length")


@dataclasses.dataclass(frozen=True)
class TableDeclaration:
    """A declared table: its name and the settings it gives (None: the job's flag).

    Args:
        name: the table's name; dim: its width (1..MAX_EMBEDDING_DIM); optimizer, lr: its
            sparse optimizer (one of SPARSE_OPTIMIZERS) and learning rate; init, init_scale:
            its initialiser (:class:`~herald.contracts.tables.TableConfig`).

    Raises:
        ConfigError: a value out of range.
    """

    name: str
    dim: int | None = None
    optimizer: str | None = None
    lr: float | None = None
    init: str | None = None
    init_scale: float | None = None

    def __post_init__(self) -> None:
        _name(self.name, "a table name")
        require(
            self.dim is None
            or (isinstance(self.dim, int) and not isinstance(self.dim, bool) and 1 <= self.dim <= MAX_EMBEDDING_DIM),
            f"table {self.name!r}: dim must be an int in 1..{MAX_EMBEDDING_DIM}, got {self.dim!r:.40}",
        )
        require(
            self.optimizer is None or (isinstance(self.optimizer, str) and self.optimizer in SPARSE_OPTIMIZERS),
            f"table {self.name!r}: optimizer {self.optimizer!r:.40} is unknown; use one of {SPARSE_OPTIMIZERS}",
        )
        require(
            self.init is None or (isinstance(self.init, str) and self.init in INITS),
            f"table {self.name!r}: init {self.init!r:.40} is unknown; use one of {INITS}",
        )
        # lr and init_scale: TableConfig's checks, when the table is resolved (check() builds one now)
        self.table(16, "sgd", 0.01)

    def table(self, dim: int, optimizer: str, lr: float) -> TableConfig:
        """The :class:`TableConfig`, with the job's ``dim``, ``optimizer`` and ``lr`` where this leaves them out.

        Raises:
            ConfigError: an lr or init_scale out of range.
        """
        opt = OptimizerConfig(
            name=self.optimizer if self.optimizer is not None else optimizer,
            lr=self.lr if self.lr is not None else lr,
        )
        extra: dict[str, Any] = {} if self.init is None else {"init": self.init}
        if self.init_scale is not None:
            extra["init_scale"] = self.init_scale
        return TableConfig(name=self.name, dim=self.dim if self.dim is not None else dim, optimizer=opt, **extra)


@dataclasses.dataclass(frozen=True)
class Declarations:
    """Declared tables and features (NOTE [tables and features]); empty: one table per feature.

    Attributes:
        tables: the declared tables, in the file's order; features: the declared features.

    Raises:
        ConfigError: duplicate names, or a feature reading a table not declared.
    """

    tables: tuple[TableDeclaration, ...] = ()
    features: tuple[FeatureConfig, ...] = ()

    def __post_init__(self) -> None:
        for what, items in (("table", self.tables), ("feature", self.features)):
            names = [x.name for x in items]
            dupes = sorted({n for n in names if names.count(n) > 1})
            require(not dupes, f"{what} names must be unique; declared more than once: {dupes}")
        declared = {t.name for t in self.tables}
        for f in self.features:
            require(
                f.table in declared,
                f"feature {f.name!r} reads table {f.table!r}, which is not declared: add [tables.{f.table}] "
                f"(declared tables: {sorted(declared)})",
            )

    def resolve(
        self, feature_names: Sequence[str], dim: int, optimizer: str, lr: float
    ) -> tuple[list[TableConfig], list[FeatureConfig]]:
        """The job's tables and one :class:`FeatureConfig` per source feature.

        Args:
            feature_names: the source's sparse features, in order (its schema's ``table_names``).
            dim, optimizer, lr: ``--embedding-dim``, ``--optimizer``, ``--lr``: tables that leave them out.

        Returns:
            ``(tables, features)``: tables in order of first use along ``feature_names``;
            ``features[i]`` is source feature ``i``'s.

        Raises:
            ConfigError: a declared feature the source lacks, a declared table no feature
                reads, or a feature's own table named as a declared table.
        """
        names = list(feature_names)
        declared = {f.name: f for f in self.features}
        missing = [n for n in declared if n not in names]
        require(
            not missing,
            f"declared feature(s) {missing} are not in the source, whose features are {names[:40]}",
        )
        by_name = {t.name: t for t in self.tables}
        features = [declared.get(n) or FeatureConfig(name=n, table=n) for n in names]
        clash = [f.name for f in features if f.name not in declared and f.name in by_name]
        require(
            not clash,
            f"feature(s) {clash} are not declared, so each reads a table of its own name, but a declared "
            "table has that name: declare the feature (table = ...) or rename the table",
        )
        order = list(dict.fromkeys(f.table for f in features))
        unused = [t.name for t in self.tables if t.name not in order]
        require(not unused, f"declared table(s) {unused} are read by no feature: remove them or name them in a feature")
        default = TableDeclaration("_")
        tables = [(by_name.get(t) or dataclasses.replace(default, name=t)).table(dim, optimizer, lr) for t in order]
        return tables, features

    @classmethod
    def from_mapping(cls, data: Any, where: str = "declarations") -> Declarations:
        """From ``{"tables": {name: {...}}, "features": {name: {...}}}`` (the file's shape).

        Raises:
            ConfigError: another shape, an unknown key (the message lists the known ones), or a bad value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a mapping of [tables.NAME] and [features.NAME] sections")
        unknown = sorted(set(data) - {"tables", "features"})
        if unknown:
            raise ConfigError(f"{where}: unknown section(s) {unknown}; use tables and features")
        try:
            tables = tuple(
                TableDeclaration(name, **_entry(entry, TABLE_KEYS, f"table {name!r}"))
                for name, entry in _section(data, "tables", where).items()
            )
            features = tuple(
                FeatureConfig(name, **_entry(entry, FEATURE_KEYS, f"feature {name!r}", required=("table",)))
                for name, entry in _section(data, "features", where).items()
            )
            return cls(tables, features)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | pathlib.Path, flag: str = "--tables") -> Declarations:
        """A declaration file: TOML, or JSON (``.json``, or text starting with ``{``).

        Raises:
            ConfigError: unreadable, not TOML/JSON, or declarations :meth:`from_mapping` refuses.
        """
        text = read_text_file(path, flag)
        where = f"{flag} {path}"
        as_json = str(path).endswith(".json") or text.lstrip().startswith("{")
        try:
            data = json.loads(text) if as_json else tomllib.loads(text)
        except RecursionError:
            raise ConfigError(f"{where} nests too deeply to be table and feature declarations") from None
        except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
            raise ConfigError(f"{where} is not valid {'JSON' if as_json else 'TOML'}: {exc}") from None
        return cls.from_mapping(data, where)

    @classmethod
    def from_torchrec(cls, configs: Sequence[Any], max_length: int = 0) -> Declarations:
        """From a list of ``torchrec.EmbeddingBagConfig`` and/or ``EmbeddingConfig`` as they are:
        each config a table (``name``, ``embedding_dim``), each of its ``feature_names`` a feature
        reading it; an ``EmbeddingBagConfig``'s ``pooling`` (SUM / MEAN) is the features' pooling,
        an ``EmbeddingConfig``'s features are sequences of at most ``max_length`` rows (TorchRec's
        ``EmbeddingCollection`` has no bound: pass it). ``num_embeddings`` is not a limit here:
        the PS holds any id (hashed keys).

        Raises:
            ConfigError: a config without ``name``, ``embedding_dim`` or ``feature_names``, an
                unsupported pooling, or what :meth:`from_mapping`'s checks refuse.
        """
        tables: dict[str, dict[str, Any]] = {}
        features: dict[str, dict[str, Any]] = {}
        for i, cfg in enumerate(configs):
            name, dim, names = (getattr(cfg, k, None) for k in ("name", "embedding_dim", "feature_names"))
            if not isinstance(name, str) or not name or dim is None or not names:
                raise ConfigError(
                    f"torchrec config {i} ({type(cfg).__name__}) needs a name, an embedding_dim and feature_names"
                )
            if name in tables:
                raise ConfigError(f"torchrec configs: table name {name!r} given twice")
            tables[name] = {"dim": int(dim)}
            pooling = getattr(cfg, "pooling", None)  # EmbeddingBagConfig has one, EmbeddingConfig none
            kind = "none" if pooling is None else str(getattr(pooling, "name", pooling)).lower()
            if kind not in POOLINGS:
                raise ConfigError(f"torchrec config {name!r}: pooling {pooling!r} is not one of {POOLINGS}")
            for f in names:
                entry: dict[str, Any] = {"table": name, "pooling": kind}
                if kind == "none":
                    entry["max_length"] = max_length
                if f in features:
                    raise ConfigError(
                        f"torchrec configs: feature {f!r} reads two tables ({features[f]['table']}, {name})"
                    )
                features[f] = entry
        return cls.from_mapping({"tables": tables, "features": features}, where="torchrec configs")

    def to_dict(self) -> dict[str, Any]:
        """The file's shape (``from_mapping``'s inverse), JSON-able."""
        return {
            "tables": {
                t.name: {k: getattr(t, k) for k in TABLE_KEYS if getattr(t, k) is not None} for t in self.tables
            },
            "features": {f.name: {k: v for k, v in f.to_dict().items() if k != "name"} for f in self.features},
        }


def _section(data: Mapping, key: str, where: str) -> Mapping:
    section = data.get(key, {})
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where}: {key} must be a mapping of names to settings, got {type(section).__name__}")
    return section


def _entry(entry: Any, keys: tuple[str, ...], what: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{what} must be a mapping of settings ({', '.join(keys)}), got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(keys))
    if unknown:
        raise ConfigError(f"{what}: unknown setting(s) {unknown}; known: {list(keys)}")
    missing = [k for k in required if k not in entry]
    if missing:
        raise ConfigError(f"{what}: missing {missing}")
    return dict(entry)
