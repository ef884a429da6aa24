"""Row-level functions shared by the PS and the worker cache: sharding, initialisation,
sparse-optimizer application. All of them call the numba kernels in
:mod:`herald.ps.kernels`, so a worker and a shard compute bit-identical rows.
"""

from __future__ import annotations

import numpy as np

from herald.contracts.tables import TableConfig
from herald.errors import ConfigError
from herald.hashing import splitmix64 as _mix
from herald.ps import kernels as K

_SHARD_SALT = 0x5EED_5AA2_D0C5_1DE5
_SEED_SALT = 0x1217_0B5E_EDC0_FFEE


def table_salt(table_index: int) -> np.uint64:
    """Per-table salt of the shard hash: ``mix64(table_index ^ SHARD_SALT)``."""
    return np.uint64(_mix((int(table_index) ^ _SHARD_SALT) & ((1 << 64) - 1)))


def table_seed(seed: int, table_index: int) -> np.uint64:
    """Per-(seed, table) state of the initialiser: ``mix64(mix64(seed ^ SEED_SALT) ^ table_index)``."""
    m = (1 << 64) - 1
    return np.uint64(_mix(_mix((int(seed) ^ _SEED_SALT) & m) ^ (int(table_index) & m)))


def _keys(keys) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.dtype != np.uint64 or keys.ndim != 1:
        raise ConfigError(
            f"keys must be a 1-d uint64 array, got {keys.dtype} {keys.shape}; "
            "ids are never narrowed to 32 bits or floats"
        )
    return np.ascontiguousarray(keys)


def shard_of(table_index: int, keys: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard of each key: ``mix64(key ^ table_salt(table_index)) mod num_shards``.

    Persia §4.2.3: a mixing hash spreads every table (hot ones included) uniformly.

    Args:
        table_index: the table's position in the declared table list.
        keys: uint64 [n].
        num_shards: > 0.

    Returns:
        int64 [n] in ``[0, num_shards)``.

    Raises:
        ConfigError: keys not 1-d uint64 or ``num_shards < 1``.
    """
    keys = _keys(keys)
    if num_shards < 1:
        raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
    out = np.empty(keys.shape[0], np.int64)
    return K.shard_of_jit(table_salt(table_index), keys, int(num_shards), out)


def init_args(tcfg: TableConfig, table_index: int, seed: int) -> tuple:
    """The trailing kernel arguments of :func:`herald.ps.kernels.init_row_jit`."""
    return (
        table_seed(seed, table_index),
        tcfg.dim,
        ("uniform", "normal", "zeros").index(tcfg.init),
        float(tcfg.init_scale),
        tcfg.optimizer.kind,
        float(tcfg.optimizer.initial_accumulator),
    )


def init_rows(tcfg: TableConfig, table_index: int, keys: np.ndarray, seed: int) -> np.ndarray:
    """Initial rows of ``keys``: what a shard stores for a key it has never seen.

    Deterministic from (seed, table_index, key): every process and restart agrees.

    Args:
        tcfg: the table.
        table_index: its position in the declared table list.
        keys: uint64 [n].
        seed: the job's seed (the same on every shard and worker).

    Returns:
        float32 [n, tcfg.row_width]: embedding by ``tcfg.init``, then optimizer state
        (``initial_accumulator`` for the adagrad variants, zeros for Adam).
    """
    keys = _keys(keys)
    rows = np.empty((keys.shape[0], tcfg.row_width), np.float32)
    return K.init_rows_jit(rows, keys, *init_args(tcfg, table_index, seed))


def hyper_params(tcfg: TableConfig) -> np.ndarray:
    """float32 [5] = (lr, eps, beta1, beta2, weight_decay): the kernels' ``hp``."""
    o = tcfg.optimizer
    return np.array([o.lr, o.eps, o.beta1, o.beta2, o.weight_decay], np.float32)


def apply_gradients(rows: np.ndarray, grads: np.ndarray, tcfg: TableConfig) -> np.ndarray:
    """Apply one sparse-optimizer step in place (the PS's kernel: bit-identical results).

    Args:
        rows: float32 [n, row_width], C-contiguous (may be a gathered copy).
        grads: float32 [n, dim], the summed gradient of each row.
        tcfg: the table (optimizer, dim).

    Returns:
        ``rows`` (updated in place).

    Raises:
        ConfigError: wrong dtype, shape or layout.
    """
    if not (
        isinstance(rows, np.ndarray)
        and rows.dtype == np.float32
        and rows.ndim == 2
        and rows.shape[1] == tcfg.row_width
        and rows.flags.c_contiguous
        and rows.flags.writeable
    ):
        raise ConfigError(f"rows must be a writeable C-contiguous float32 [n, {tcfg.row_width}] array")
    grads = np.ascontiguousarray(grads)
    if grads.dtype != np.float32 or grads.shape != (rows.shape[0], tcfg.dim):
        raise ConfigError(f"grads must be float32 [{rows.shape[0]}, {tcfg.dim}], got {grads.dtype} {grads.shape}")
    K.apply_rows_jit(rows, grads, tcfg.optimizer.kind, tcfg.dim, hyper_params(tcfg))
    return rows


def apply_gradients_at(
    rows: np.ndarray, slots: np.ndarray, grads: np.ndarray, grad_rows: np.ndarray, tcfg: TableConfig
) -> None:
    """:func:`apply_gradients` on ``rows[slots[i]]`` with ``grads[grad_rows[i]]``, in place
    (no gather/scatter copies; bit-identical to gathering, applying and scattering).

    Args:
        rows: float32 [capacity, row_width], C-contiguous, writeable (e.g. the worker cache).
        slots: int64 [n], distinct rows to update; grads: float32 [m, dim];
        grad_rows: int64 [n], the gradient row of each slot.
        tcfg: the table (optimizer, dim); every updated row must belong to such a table.

    Raises:
        ConfigError: wrong dtype, shape or layout.
    """
    if not (
        rows.dtype == np.float32
        and rows.ndim == 2
        and rows.shape[1] == tcfg.row_width
        and rows.flags.c_contiguous
        and rows.flags.writeable
    ):
        raise ConfigError(f"rows must be a writeable C-contiguous float32 [n, {tcfg.row_width}] array")
    grads = np.ascontiguousarray(grads, np.float32)
    if grads.ndim != 2 or grads.shape[1] != tcfg.dim or slots.shape != grad_rows.shape:
        raise ConfigError(f"grads must be float32 [m, {tcfg.dim}] and slots/grad_rows of one length")
    K.apply_rows_at_jit(
        rows,
        slots.astype(np.int64, copy=False),
        grads,
        grad_rows.astype(np.int64, copy=False),
        tcfg.optimizer.kind,
        tcfg.dim,
        hyper_params(tcfg),
    )
