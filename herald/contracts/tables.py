"""Table and sparse-optimizer settings: the contract shared by the PS shards, the client,
the worker cache and the job spec.

Row layout (docs/design.md, "Consistency protocol"): one float32 row per key holding
the embedding (``dim`` values) followed by the optimizer state (``state_dim`` values):

    sgd              [ w(dim) ]
    adagrad          [ w(dim) | sum_sq(dim) ]
    rowwise_adagrad  [ w(dim) | sum_sq_mean(1) ]
    adam             [ w(dim) | m(dim) | v(dim) | step(1) ]

Adam's per-row step count is stored as a float32 in the row, so it is exact up to
2**24 = 16,777,216 updates of that row; beyond that the count stops growing by 1 and
the bias correction (already 1 to float32 precision there) is unaffected in practice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from herald.config import from_mapping, require
from herald.contracts.vocab import INITS, SPARSE_OPTIMIZERS
from herald.errors import ConfigError

#: The sparse optimizers; ``OPTIMIZERS.index(name)`` is the kernels' optimizer code.
OPTIMIZERS = SPARSE_OPTIMIZERS
DTYPES = ("float32",)
#: Longest table name: names travel in every declare and in reports, and a name is a label, not data.
MAX_TABLE_NAME_CHARS = 256


def _finite(cfg: Any, name: str, span: str, check, label: str) -> None:
    """Check that ``cfg.name`` is a finite real number (not a bool) passing ``check``."""
    value = getattr(cfg, name)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and check(value)
    require(ok, f"{label} must be a finite number {span}, got {value!r:.40}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """A sparse optimizer (Persia §4.2.2: optimizer state lives in the row).

    Args:
        name: one of ``sgd``, ``adagrad`` (element-wise), ``rowwise_adagrad``, ``adam``.
        lr: learning rate (> 0).
        eps: added to the denominator (adagrad, rowwise_adagrad, adam).
        beta1, beta2: Adam's moment decay rates, in [0, 1).
        initial_accumulator: initial sum of squares (adagrad variants), >= 0.
        weight_decay: L2 penalty added to the gradient (torch semantics), >= 0.

    Raises:
        ConfigError: unknown name or a value out of range.
    """

    name: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and self.name in OPTIMIZERS,
            f"optimizer {self.name!r:.60} is unknown; use one of {OPTIMIZERS}",
        )
        _finite(self, "lr", "> 0", lambda x: x > 0, "optimizer lr")
        _finite(self, "eps", ">= 0", lambda x: x >= 0, "optimizer eps")
        _finite(self, "beta1", "in [0, 1)", lambda x: 0 <= x < 1, "adam beta1")
        _finite(self, "beta2", "in [0, 1)", lambda x: 0 <= x < 1, "adam beta2")
        _finite(self, "initial_accumulator", ">= 0", lambda x: x >= 0, "initial_accumulator")
        _finite(self, "weight_decay", ">= 0", lambda x: x >= 0, "weight_decay")

    @property
    def kind(self) -> int:
        """The kernel's optimizer code (index in :data:`OPTIMIZERS`)."""
        return OPTIMIZERS.index(self.name)

    def state_dim(self, dim: int) -> int:
        """Optimizer state floats per row: sgd 0, adagrad ``dim``, rowwise 1, adam ``2*dim + 1``."""
        return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim + 1}[self.name]


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Args:
        name: unique table name.
        dim: embedding dimension (> 0).
        optimizer: its sparse optimizer.
        init: ``uniform`` (-init_scale, init_scale), ``normal`` (0, init_scale) or ``zeros``.
        init_scale: scale of the initialiser (>= 0).
        dtype: storage dtype; only ``float32``.

    Raises:
        ConfigError: a value out of range.
    """

    name: str
    dim: int
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    init: str = "uniform"
    init_scale: float = 0.05
    dtype: str = "float32"

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and 0 < len(self.name) <= MAX_TABLE_NAME_CHARS and self.name.isprintable(),
            f"table name must be a non-empty printable string of at most {MAX_TABLE_NAME_CHARS} characters, "
            f"got {self.name!r:.60}",
        )
        if isinstance(self.optimizer, Mapping):
            object.__setattr__(
                self, "optimizer", from_mapping(OptimizerConfig, self.optimizer, where=f"table {self.name!r} optimizer")
            )
        require(
            isinstance(self.optimizer, OptimizerConfig),
            f'table {self.name!r}: optimizer must be a mapping such as {{"name": "adagrad", "lr": 0.05}}, '
            f"got {self.optimizer!r:.60}",
        )
        require(
            isinstance(self.dim, int) and not isinstance(self.dim, bool) and self.dim > 0,
            f"table {self.name!r}: dim must be a positive int, got {self.dim!r:.40}",
        )
        require(
            isinstance(self.init, str) and self.init in INITS,
            f"table {self.name!r}: init {self.init!r:.40} is unknown; use one of {INITS}",
        )
        _finite(self, "init_scale", ">= 0", lambda x: x >= 0, f"table {self.name!r}: init_scale")
        require(
            isinstance(self.dtype, str) and self.dtype in DTYPES,
            f"table {self.name!r}: dtype {self.dtype!r:.40} unsupported; use float32",
        )

    @property
    def state_dim(self) -> int:
        return self.optimizer.state_dim(self.dim)

    @property
    def row_width(self) -> int:
        """Floats per row: ``dim + state_dim``."""
        return self.dim + self.state_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> TableConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise :class:`ConfigError`."""
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"a table declaration must be a mapping, got {type(mapping).__name__}")
        return from_mapping(cls, mapping, where="table")


def tables_from_json(text: str, where: str = "tables file") -> list[TableConfig]:
    """Parse a JSON list of table mappings (the ``--tables`` file of ``herald serve ps``),
    each through :class:`TableConfig`'s checks (types, finite numbers, name length).

    Args:
        text: the file's text; where: how errors name it (``--tables FILE``).

    Raises:
        ConfigError: not JSON, not a non-empty list of mappings, or a table the checks refuse.
    """
    try:
        data = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{where} nests too deeply to be a list of table mappings") from None
    except ValueError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ConfigError(f"{where} must hold a JSON list of table mappings, got a {type(data).__name__}")
    if not data:
        raise ConfigError(f"{where} lists no table: declare at least one, or leave the file out")
    try:
        return check_tables([TableConfig.from_dict(d) for d in data])
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def tables_to_json(tables: Sequence[TableConfig]) -> str:
    return json.dumps([t.to_dict() for t in tables], indent=1)


def check_tables(tables: Sequence[TableConfig]) -> list[TableConfig]:
    """Validate a table list (types, unique names); returns it as a list."""
    tables = list(tables)
    for t in tables:
        if not isinstance(t, TableConfig):
            raise ConfigError(f"tables must be TableConfig objects, got {type(t).__name__}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ConfigError(f"table names must be unique, got {names}")
    return tables
