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
    if table.shape[0] == 0:
        return
    order = np.argsort(table, kind="stable")
    sorted_t = table[order]
    cuts = np.flatnonzero(sorted_t[1:] != sorted_t[:-1]) + 1
    starts = np.concatenate(([0], cuts)).tolist()
    ends = np.concatenate((cuts, [table.shape[0]])).tolist()
    for t, a, b in zip(sorted_t[starts].tolist(), starts, ends):
        yield t, order[a:b]


def pull_keys_async(ps: PSClient, keys: KeySet, row_width: int) -> Callable[[], np.ndarray]:
    """Start pulling ``keys``; the returned ``wait()`` gives float32 [len(keys), row_width]:
    the PS rows (embedding + optimizer state) in key order."""
    groups = dict(table_groups(keys.table))
    handle = ps.pull_async({t: keys.ids[m] for t, m in groups.items()})

    def wait() -> np.ndarray:
        rows = np.empty((len(keys), row_width), np.float32)
        got = handle.wait()
        for t, m in groups.items():
            rows[m] = got[t]
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
    parts = {t: (keys.ids[m], np.ascontiguousarray(rows[m])) for t, m in table_groups(keys.table)}
    return ps.push_rows_async(parts), keys.ids.nbytes + rows.nbytes


def push_rows(ps: PSClient, keys: KeySet, rows: np.ndarray) -> int:
    """Write ``rows`` (float32 [len(keys), row_width]) back for ``keys`` and wait; returns the bytes sent."""
    handle, sent = push_rows_async(ps, keys, rows)
    if handle is not None:
        handle.wait()
    return sent


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
