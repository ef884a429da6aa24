"""A worker's cache in a checkpoint off the checkpoint grid (NOTE [warm resume] in
herald/dispatch/warm.py): saved on ``save {path, caches: true}``, loaded by a resumed
worker whose job says ``resume_caches``.

``cache-rank<R>.npz`` holds the cache's slot map (which slot holds which key, the free
slots in order: :meth:`~herald.worker.cache.SlotMap.map_state`), the cached keys with
their rows (embedding + optimizer state, as the cache holds them: the latest copies and
the stale ones a relaxed protocol may still read) and the protocol's per-copy state
(:meth:`~herald.worker.protocol.ConsistencyProtocol.warm_arrays`: HET's clocks under
bounded staleness). Loaded back, the cache holds every key in the same slot with the
same row, so it equals the scheduler's restored snapshot as in the uninterrupted run.
"""

from __future__ import annotations

import pathlib

import numpy as np

from herald.contracts.plan import KeySet
from herald.errors import DataError
from herald.files import read_arrays, write_arrays


def cache_file(folder: str | pathlib.Path, rank: int) -> pathlib.Path:
    """Where worker ``rank`` saves its cache in the checkpoint ``folder``."""
    return pathlib.Path(folder) / f"cache-rank{rank}.npz"


def save_cache(folder: str | pathlib.Path, rank: int, executor, protocol) -> pathlib.Path:
    """Write worker ``rank``'s cache (its :class:`~herald.worker.executor.PlanExecutor`'s) and
    ``protocol``'s per-copy state into the checkpoint ``folder``; returns the file.

    Raises:
        StorageError: the write failed (naming the file, why and the fix).
    """
    cache = executor.cache
    keys = cache.key_set()
    arrays = {f"map.{k}": v for k, v in cache.map_state().items()}
    arrays.update(table=keys.table, ids=keys.ids, rows=cache.read(cache.slots(keys)))
    arrays.update({f"protocol.{k}": v for k, v in protocol.warm_arrays().items()})
    path = cache_file(folder, rank)
    write_arrays(path, arrays)
    return path


def save_checkpoint_part(path: str, dense, executor, protocol, caches: bool) -> None:
    """A worker's part of a checkpoint in the folder ``path`` (``save {path, caches}``, NOTE
    [dispatch protocol]): rank 0 writes the dense state (``dense``, a
    :class:`~herald.worker.dense.DenseState`), and with ``caches`` every rank its cache
    (:func:`save_cache`).

    Raises:
        StorageError: a write failed (naming the file, why and the fix).
    """
    if executor.rank == 0:
        dense.save(path)
    if caches:
        save_cache(path, executor.rank, executor, protocol)


def load_cache(folder: str | None, rank: int, executor, protocol) -> None:
    """Fill worker ``rank``'s empty cache and ``protocol``'s per-copy state from the
    checkpoint ``folder`` (what :func:`save_cache` wrote).

    Raises:
        DataError: no such file, or one that does not fit this cache (another capacity,
            row width or mode), naming the file.
    """
    if folder is None:
        raise DataError("the job asks to resume the worker caches but names no checkpoint folder (resume_dense)")
    path = cache_file(folder, rank)
    arrays = read_arrays(path)

    def part(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

    cache = executor.cache
    table, ids, rows = arrays.get("table"), arrays.get("ids"), arrays.get("rows")
    if (
        table is None
        or ids is None
        or rows is None
        or table.shape != ids.shape
        or rows.shape != (ids.shape[0], cache.row_width)
        or rows.dtype != np.float32
    ):
        raise DataError(
            f"checkpoint file {path} holds no cache of {cache.row_width}-float rows; resume with the same tables"
        )
    try:
        cache.load_map_state(part("map."))
        keys = KeySet(table.astype(np.int32), ids.astype(np.uint64))
        if len(keys) != len(cache):
            raise DataError(f"its keys ({len(keys)}) and its slot map ({len(cache)} keys) disagree")
        cache.put(keys, rows)
        protocol.load_warm_arrays(part("protocol."))
    except DataError as exc:
        raise DataError(f"checkpoint file {path}: {exc}") from None
