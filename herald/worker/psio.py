"""Moving a worker's KeySets to and from the PS, and finding keys in a step's rows.

Shared by the plan executor (:mod:`herald.worker.api`) and the replicated tables
(:mod:`herald.worker.replicas`). A KeySet may hold several tables; each call sends one
multi-table request per shard, in parallel, and waits for the answers.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from herald.errors import ProtocolError
from herald.ps import PSClient
from herald.scheduler.plan import KeySet
from herald.worker.kernels import positions_jit


def table_groups(table: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(table index, int64 positions)`` for each table present in ``table`` (int32 [n]),
    tables ascending, positions ascending: indexing with them selects exactly what the
    boolean mask ``table == t`` would, in one stable sort instead of one pass per table."""
    order, runs = table_runs(table)
    for t, a, b in runs:
        yield t, order[a:b]


def table_runs(table: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """``(order, [(table index, start, end)])``: ``order`` (int64 [n]) sorts ``table`` (int32
    [n]) stably, and ``order[start:end]`` are table t's positions, ascending (what
    :func:`table_groups` yields): one gather by ``order`` then gives every table's part
    as a contiguous slice."""
    if table.shape[0] == 0:
        return np.zeros(0, np.int64), []
    order = np.argsort(table, kind="stable")
    sorted_t = table[order]
    cuts = np.flatnonzero(sorted_t[1:] != sorted_t[:-1]) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), table.shape[0]]
    return order, list(zip(sorted_t[starts].tolist(), starts, ends))


def pull_keys_async(ps: PSClient, keys: KeySet, row_width: int) -> Callable[[], np.ndarray]:
    """Start pulling ``keys``; the returned ``wait()`` gives float32 [len(keys), row_width]:
    the PS rows (embedding + optimizer state) in key order."""
    order, runs = table_runs(keys.table)
    ids = keys.ids[order]
    handle = ps.pull_async({t: ids[a:b] for t, a, b in runs})

    def wait() -> np.ndarray:
        got = handle.wait()
        rows = np.empty((len(keys), row_width), np.float32)
        if runs:
            rows[order] = got[runs[0][0]] if len(runs) == 1 else np.concatenate([got[t] for t, _, _ in runs])
        return rows

    return wait


def pull_keys(ps: PSClient, keys: KeySet, row_width: int) -> np.ndarray:
    """float32 [len(keys), row_width]: the PS rows (embedding + optimizer state) of ``keys``, in order."""
    return pull_keys_async(ps, keys, row_width)()


def push_rows_async(ps: PSClient, keys: KeySet, rows: np.ndarray):
    """Start writing ``rows`` (float32 [len(keys), row_width]) back for ``keys``; returns
    ``(handle or None, bytes sent)``. ``rows`` must not change until ``handle.wait()``."""
    if not len(keys):
        return None, 0
    order, runs = table_runs(keys.table)
    ids, by_table = keys.ids[order], np.asarray(rows, np.float32)[order]   # one gather, then slices
    parts = {t: (ids[a:b], by_table[a:b]) for t, a, b in runs}
    return ps.push_rows_async(parts), keys.ids.nbytes + rows.nbytes


def push_rows(ps: PSClient, keys: KeySet, rows: np.ndarray) -> int:
    """Write ``rows`` (float32 [len(keys), row_width]) back for ``keys`` and wait; returns the bytes sent."""
    handle, sent = push_rows_async(ps, keys, rows)
    if handle is not None:
        handle.wait()
    return sent


def member(keys: KeySet, of: KeySet) -> np.ndarray:
    """bool [len(keys)]: whether each (table, id) of ``keys`` is in ``of`` (exact: ids compared whole)."""
    out = np.zeros(len(keys), bool)
    if not len(keys) or not len(of):
        return out
    other = {t: of.ids[m] for t, m in table_groups(of.table)}
    for t, m in table_groups(keys.table):
        if t in other:
            out[m] = np.isin(keys.ids[m], other[t])
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
