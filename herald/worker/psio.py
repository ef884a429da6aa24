"""Moving a worker's KeySets to and from the PS, and finding keys in a step's rows.

Shared by the plan executor (:mod:`herald.worker.api`) and the replicated tables
(:mod:`herald.worker.replicas`). A KeySet may hold several tables; each call sends one
request per shard carrying every table's keys as one flat part (NOTE [ps wire protocol]:
tables and ids as they are, no per-table split), in parallel, and waits for the answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from herald.contracts.plan import KeySet
from herald.errors import ProtocolError
from herald.ps import PSClient
from herald.worker.kernels import member_jit, pairs_sorted_jit, positions_jit


def table_groups(table: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(table index, int64 positions)`` for each table present in ``table`` (int32 [n]),
    tables ascending, positions ascending: indexing with them selects exactly what the
    boolean mask ``table == t`` would, in one stable sort instead of one pass per table."""
    order, runs = table_runs(table)
    for t, a, b in runs:
        yield t, order[a:b]


def table_runs(table: np.ndarray, first: np.ndarray | None = None) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """``(order, [(table index, start, end)])``: ``order`` (int64 [n]) sorts ``table`` (int32
    [n]) stably, and ``order[start:end]`` are table t's positions, ascending (what
    :func:`table_groups` yields): one gather by ``order`` then gives every table's part
    as a contiguous slice. With ``first`` (bool [n]) each table's positions where it is
    True come first (each group ascending)."""
    if table.shape[0] == 0:
        return np.zeros(0, np.int64), []
    order = np.argsort(table, kind="stable") if first is None else np.lexsort((~first, table))
    sorted_t = table[order]
    cuts = np.flatnonzero(sorted_t[1:] != sorted_t[:-1]) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), table.shape[0]]
    return order, list(zip(sorted_t[starts].tolist(), starts, ends))


def pull_keys_async(ps: PSClient, keys: KeySet, row_width: int) -> Callable[[], np.ndarray]:
    """Start pulling ``keys`` (one flat request per shard: NOTE [ps wire protocol]); the
    returned ``wait()`` gives float32 [len(keys), row_width] (writeable): the PS rows
    (embedding + optimizer state) in key order."""
    if not len(keys):
        return lambda: np.empty((0, row_width), np.float32)
    handle = ps.pull_flat_async(keys.table, keys.ids)

    def wait() -> np.ndarray:
        rows = handle.wait()
        return rows if rows.flags.writeable else rows.copy()  # one shard's reply frame is read-only

    return wait


def pull_keys(ps: PSClient, keys: KeySet, row_width: int) -> np.ndarray:
    """float32 [len(keys), row_width]: the PS rows (embedding + optimizer state) of ``keys``, in order."""
    return pull_keys_async(ps, keys, row_width)()


@dataclasses.dataclass
class Fetched:
    """What :func:`fetch_async` got, in key order.

    Attributes:
        rows: float32 [n, row_width]: the PS rows where ``fetched`` (unset elsewhere).
        fetched: bool [n]: rows that came (False: a checked copy is still valid).
        clocks: uint64 [n]: c_g of the keys asked with clocks, 0 elsewhere.
    """

    rows: np.ndarray
    fetched: np.ndarray
    clocks: np.ndarray


def fetch_async(
    ps: PSClient,
    keys: KeySet,
    row_width: int,
    clocked: np.ndarray | None = None,
    checked: np.ndarray | None = None,
    c_c: np.ndarray | None = None,
    staleness: int = 0,
) -> Callable[[], Fetched]:
    """Start pulling ``keys``, those marked ``clocked`` (bool [n]) in one conditional pull
    with their PS clocks (NOTE [clock frames] in herald/ps/wire.py), the others in a plain
    one, both at once; the returned ``wait()`` gives a :class:`Fetched`.

    Args:
        checked: bool [n] (within ``clocked``) or None: keys whose cached copy the shard may
            find valid (``c_g <= c_c + staleness``) and then not send.
        c_c: uint64 [n]: the copies' current clocks (read where ``checked``).
    """
    n = len(keys)
    if clocked is None:  # a plain pull: its rows as they come
        rows_wait = pull_keys_async(ps, keys, row_width)
        return lambda: Fetched(rows_wait(), np.ones(n, bool), np.zeros(n, np.uint64))
    checked = np.zeros(n, bool) if checked is None else checked & clocked
    plain = ~clocked
    plain_wait = pull_keys_async(ps, KeySet(keys.table[plain], keys.ids[plain]), row_width) if plain.any() else None
    clock_wait = None
    if clocked.any():
        at = np.flatnonzero(clocked)
        c_c = np.zeros(n, np.uint64) if c_c is None else np.asarray(c_c, np.uint64)
        handle, _ = ps.pull_clocked_flat_async(keys.table[at], keys.ids[at], checked[at], c_c[at], staleness)
        clock_wait = (handle, at)

    def wait() -> Fetched:
        fetched, clocks = np.ones(n, bool), np.zeros(n, np.uint64)
        if clock_wait is None:  # a plain pull: its rows as they come
            rows = plain_wait() if plain_wait is not None else np.empty((0, row_width), np.float32)
            return Fetched(rows, fetched, clocks)
        rows = np.empty((n, row_width), np.float32)
        if plain_wait is not None:
            rows[plain] = plain_wait()
        handle, at = clock_wait
        c_g, ok, r, _ = handle.wait()
        clocks[at], fetched[at], rows[at] = c_g, ok, r
        return Fetched(rows, fetched, clocks)

    return wait


def push_rows_async(
    ps: PSClient, keys: KeySet, rows: np.ndarray, advance: np.ndarray | None = None, read_clocks: bool = False
):
    """Start writing ``rows`` (float32 [len(keys), row_width]) back for ``keys`` (one flat
    request per shard), with their clock ``advance`` (uint64 [n], NOTE [clock frames]) when
    given; returns the handle (None for no keys). ``rows`` must not change until
    ``handle.wait()``, which gives None, or with ``advance`` the c_g after (uint64 [n] in key
    order; None without ``read_clocks``); a clocked handle is also callable (``handle()``)."""
    if not len(keys):
        return None
    rows = np.asarray(rows, np.float32)
    if advance is None:
        return ps.push_rows_flat_async(keys.table, keys.ids, rows)
    handle, _ = ps.push_rows_clocked_flat_async(keys.table, keys.ids, rows, advance, read_clocks)

    def wait():  # may be called again: the handle keeps its reply
        return handle.wait()[0]

    wait.wait = wait
    return wait


def push_grads_async(ps: PSClient, keys: KeySet, grads: np.ndarray, contributors: np.ndarray, step: int, rank: int):
    """Start pushing ``grads`` (float32 [len(keys), dim]) of ``keys`` (unique) with their
    ``contributors`` (uint16 [len(keys)]) for ``step`` from ``rank`` (NOTE [ps aggregation]):
    one flat request per shard; returns the handle (``wait()`` gives the rows the shards
    updated)."""
    return ps.push_grad_flat_async(keys.table, keys.ids, grads, contributors, step, rank)


def push_rows(ps: PSClient, keys: KeySet, rows: np.ndarray) -> None:
    """Write ``rows`` (float32 [len(keys), row_width]) back for ``keys`` and wait."""
    handle = push_rows_async(ps, keys, rows)
    if handle is not None:
        handle.wait()


def member(keys: KeySet, of: KeySet) -> np.ndarray:
    """bool [len(keys)]: whether each (table, id) of ``keys`` is in ``of`` (exact: ids compared whole;
    used by the executor and by NOTE [bounded reads])."""
    out = np.zeros(len(keys), bool)
    if not len(keys) or not len(of):
        return out
    o_table, o_ids = of.table.astype(np.int32, copy=False), of.ids
    if not pairs_sorted_jit(o_table, o_ids):  # the plan's KeySets mostly are: then no sort
        order = np.lexsort((o_ids, o_table))
        o_table, o_ids = o_table[order], o_ids[order]
    member_jit(keys.table.astype(np.int32, copy=False), keys.ids, o_table, o_ids, out)
    return out


def positions(uniq: np.ndarray, bounds: np.ndarray, keys: KeySet) -> np.ndarray:
    """int64 [n]: index of each of ``keys`` in ``uniq`` (uint64, each table's ids sorted,
    table t at ``uniq[bounds[t]:bounds[t+1]]``).

    Raises:
        ProtocolError: a key is not in ``uniq``.
    """
    out = np.empty(len(keys), np.int64)
    bad = positions_jit(uniq, bounds, keys.table, keys.ids, out)
    if bad >= 0:
        raise ProtocolError(f"key (table {keys.table[bad]}, id {keys.ids[bad]}) is not among this step's keys")
    return out
