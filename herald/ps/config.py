"""What one PS shard accepts: :class:`ShardLimits` (NOTE [ps limits] in docs/ps.md).

The tables themselves (:class:`~herald.contracts.tables.TableConfig`) are part of the job's
contract and live in :mod:`herald.contracts.tables`.
"""

from __future__ import annotations

import dataclasses

from herald.config import require
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS, MAX_PS_SHARDS, SPARSE_OPTIMIZERS
from herald.errors import ConfigError
from herald.inputs import host_memory_bytes

#: Most tables a shard can hold at all: table positions travel as uint16 (NOTE [ps wire protocol]).
MAX_TABLES = 1 << 16
#: Most shards of one job (``--num-shards``).
MAX_SHARDS = MAX_PS_SHARDS
#: The share of this host's memory the PS shards on it may fill together by default (the rest:
#: the processes' own memory, the workers and dispatcher of a local job, the page cache).
HOST_SHARE = 3 / 4


def host_shard_bytes(shards_on_host: int = 1) -> int:
    """Default ``max_shard_bytes`` of each of ``shards_on_host`` shards on this host:
    :data:`HOST_SHARE` of its memory (:func:`herald.inputs.host_memory_bytes`, the cgroup's
    limit when lower) split between them, in bytes (NOTE [ps limits])."""
    return max(1, int(host_memory_bytes() * HOST_SHARE) // max(1, int(shards_on_host)))


@dataclasses.dataclass(frozen=True)
class ShardLimits:
    """What one PS shard accepts (NOTE [ps limits] in docs/ps.md); every request over a
    limit is refused with an error naming the limit and its ``herald serve ps`` option,
    before any state changes.

    Args:
        max_keys_per_request: keys in one pull / push request, summed over its parts
            (``--max-keys-per-request``; :class:`~herald.ps.PSClient` splits larger
            operations by itself). 1,048,576 by default: a pull of that many unseen keys
            of a 128-dim SGD table adds 512 MiB of rows, about a second of the shard's time.
        max_dim: largest embedding dimension a table may declare (``--max-dim``).
        max_table_bytes: largest row array of one table on this shard, in bytes
            (``--max-table-bytes``): checked at declare (one row must fit) and whenever
            new keys would grow the table past it.
        max_contributors: largest ``contributors`` value of a gradient push and the
            bound on ``rank`` (``--max-contributors``; set it to the job's workers). A
            ``declare`` carrying ``workers`` lowers the bound to that count.
        aggregation_timeout_ms: an open aggregation (NOTE [ps aggregation]) that has
            not completed this long after its step's first contribution is aborted,
            counted and reported with the missing ranks (``--aggregation-timeout-ms``).
        max_rows: rows one table holds at most on this shard (``--max-rows``; ``herald
            train --ps-max-rows``); least recently used rows beyond it are evicted and
            re-initialised on their next touch (NOTE [bounded ps], Persia §4.2.2). 0: no bound.
        max_shard_bytes: the memory of all tables on this shard together, in bytes
            (``--max-shard-bytes``): each table's allocated rows times its row bytes plus
            ``ROW_OVERHEAD_BYTES`` (its key, marks, clock and key-map share: herald/ps/table.py).
            Checked at declare (the new tables' first rows), at restore, and whenever a
            table's row array would grow (the request is refused, nothing inserted). By
            default 3/4 of this host's memory (:func:`host_shard_bytes`; ``herald train``
            splits it between the shards it starts): the per-table ``max_table_bytes`` alone
            bounds nothing once a job declares many tables.
        max_tables: tables one shard accepts (``--max-tables``; at most 65,536, the uint16
            table positions of the wire), checked at declare.

    Raises:
        ConfigError: a value out of range.
    """

    max_keys_per_request: int = 1 << 20
    max_dim: int = 4096
    max_table_bytes: int = 16 << 30
    max_contributors: int = 1024
    aggregation_timeout_ms: int = DEFAULT_TIMEOUT_MS
    max_rows: int = 0
    max_shard_bytes: int = dataclasses.field(default_factory=host_shard_bytes)
    max_tables: int = 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v, least = getattr(self, f.name), 0 if f.name == "max_rows" else 1
            require(type(v) is int and v >= least, f"PS limit {f.name} must be an int >= {least}, got {v!r}")
        require(
            self.max_contributors <= 65535,
            f"max_contributors must be <= 65535 (contributors travel as uint16), got {self.max_contributors}",
        )
        require(
            self.max_tables <= MAX_TABLES,
            f"max_tables must be <= {MAX_TABLES} (table positions travel as uint16), got {self.max_tables}",
        )

    def check_table(self, tcfg: TableConfig) -> None:
        """Raise :class:`ConfigError` unless ``tcfg`` fits these limits (Python ints: no overflow)."""
        if tcfg.dim > self.max_dim:
            raise ConfigError(
                f"table {tcfg.name!r}: dim {tcfg.dim} exceeds this shard's max_dim={self.max_dim}; "
                "use a smaller dim or start the shards with a larger --max-dim"
            )
        row_bytes = int(tcfg.row_width) * 4
        if row_bytes > self.max_table_bytes:
            raise ConfigError(
                f"table {tcfg.name!r}: one row takes {row_bytes} bytes, more than this shard's "
                f"max_table_bytes={self.max_table_bytes}; raise --max-table-bytes"
            )

    def check_declare(self, n_tables: int, shard_bytes: int) -> None:
        """Raise :class:`ConfigError` unless a declare leaving the shard with ``n_tables``
        tables taking ``shard_bytes`` bytes (their first rows: herald/ps/table.py) fits."""
        if n_tables > self.max_tables:
            raise ConfigError(
                f"declare: {n_tables} tables, more than this shard's max_tables={self.max_tables}; "
                "declare fewer tables or start the shards with a larger --max-tables"
            )
        if shard_bytes > self.max_shard_bytes:
            raise ConfigError(
                f"declare: {n_tables} tables would take {shard_bytes} bytes on this shard with their "
                f"first rows, past its max_shard_bytes={self.max_shard_bytes}; add PS shards or "
                "raise --max-shard-bytes"
            )

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


#: The largest dense gradient a BSP worker sends in its step messages (NOTE [dense gradients
#: on the shards] in herald/ps/stepped.py): above it the all-reduce's ring moves fewer bytes
#: through each process. A shard's frame bound (:func:`largest_frame_bytes`) admits it.
DENSE_MAX_BYTES = 8 << 20


def largest_frame_bytes(limits: ShardLimits) -> int:
    """The largest array frame of a request a shard with ``limits`` serves, in bytes: its
    socket's bound (NOTE [message size limits] in herald/wire.py; header frames are
    bounded apart, by ``herald.ps.wire.PS``).

    A request (or one section of a step message: NOTE [step messages]) carries at most
    ``max_keys_per_request`` keys, and its largest frame is the rows of a ``push_rows``:
    one float32 row per key, as wide as a table may be (``max_dim`` values plus the
    widest optimizer state, Adam's ``2 * max_dim + 1``). Keys, tables, contributors,
    clocks, gradients and compressed payloads are no larger. Every row such a frame
    carries is one the shard then holds, so no legitimate frame is larger than
    ``max_shard_bytes`` either: the bound is the smaller of the two, a host's memory at
    most. A GBA dense gradient (float32 [P], NOTE [gba tokens]) must fit it as well: ``4 *
    P`` bytes at most. It is at least :data:`DENSE_MAX_BYTES`, so a BSP step message's dense
    slice always fits. ``herald serve ps --tables`` sets ``max_dim`` to the widest table's
    dim unless ``--max-dim`` is given, so the bound follows the job's tables.
    """
    widest = max(limits.max_dim + OptimizerConfig(name).state_dim(limits.max_dim) for name in SPARSE_OPTIMIZERS)
    rows = min(limits.max_keys_per_request * max(4 * widest, 8), limits.max_shard_bytes)
    return max(rows, DENSE_MAX_BYTES)
