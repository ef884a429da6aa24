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
from collections.abc import Mapping, Sequence
from typing import Any

from herald.config import from_mapping, require
from herald.contracts.vocab import INITS, SPARSE_OPTIMIZERS
from herald.errors import ConfigError

#: The sparse optimizers; ``OPTIMIZERS.index(name)`` is the kernels' optimizer code.
OPTIMIZERS = SPARSE_OPTIMIZERS
DTYPES = ("float32",)


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
        require(self.name in OPTIMIZERS, f"optimizer {self.name!r} is unknown; use one of {OPTIMIZERS}")
        require(self.lr > 0, f"optimizer lr must be > 0, got {self.lr}")
        require(self.eps >= 0, f"optimizer eps must be >= 0, got {self.eps}")
        require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"adam betas must be in [0, 1), got {self.beta1}, {self.beta2}"
        )
        require(self.initial_accumulator >= 0, f"initial_accumulator must be >= 0, got {self.initial_accumulator}")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")

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
        if isinstance(self.optimizer, Mapping):
            object.__setattr__(
                self, "optimizer", from_mapping(OptimizerConfig, self.optimizer, where=f"table {self.name!r} optimizer")
            )
        require(isinstance(self.name, str) and self.name != "", "table name must be a non-empty string")
        require(isinstance(self.dim, int) and self.dim > 0, f"table {self.name!r}: dim must be a positive int")
        require(self.init in INITS, f"table {self.name!r}: init {self.init!r} is unknown; use one of {INITS}")
        require(self.init_scale >= 0, f"table {self.name!r}: init_scale must be >= 0")
        require(self.dtype in DTYPES, f"table {self.name!r}: dtype {self.dtype!r} unsupported; use float32")

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


def tables_from_json(text: str) -> list[TableConfig]:
    """Parse a JSON list of table mappings (the ``--tables`` file of ``herald serve ps``)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"tables file is not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise ConfigError("tables file must hold a JSON list of table mappings")
    return check_tables([TableConfig.from_dict(d) for d in data])


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
