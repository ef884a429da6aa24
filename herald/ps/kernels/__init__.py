"""Numba kernels of the parameter server (and of the worker cache, which reuses the row kernels).

Pure functions over preallocated arrays; the Python around them validates, allocates
and grows arrays. Nothing here is fastmath: the same kernel gives bit-identical results
in every process (NOTE [ps exactness] in docs/ps.md). By what they do:

- :mod:`~herald.ps.kernels.rows`: a key's shard, initialising, updating (the sparse
  optimizers), checking and copying rows; shared with the worker (re-exported here);
- :mod:`~herald.ps.kernels.directory`: NOTE [table directory] (every table of a shard
  reached from one call), the room check and the slot lookups of a flat part;
- :mod:`~herald.ps.kernels.flat`: a pull's copy, the conditional pull, the write-back;
- :mod:`~herald.ps.kernels.aggregate`: the gradient push, NOTE [ps aggregation].

The key -> row map of a table is the shared one (NOTE [key map] in :mod:`herald.keymap`;
Persia §4.2.2 keeps rows in an array list, the map indexes it).
"""

from herald.ps.kernels.rows import (
    ADAGRAD,
    ADAM,
    INIT_NORMAL,
    INIT_UNIFORM,
    INIT_ZEROS,
    ROWWISE_ADAGRAD,
    SGD,
    apply_row_jit,
    apply_rows_at_jit,
    apply_rows_jit,
    copy_rows_jit,
    finite_rows_jit,
    init_row_jit,
    init_rows_jit,
    put_rows_jit,
    shard_of_jit,
    shard_order_jit,
)

__all__ = [
    "ADAGRAD",
    "ADAM",
    "INIT_NORMAL",
    "INIT_UNIFORM",
    "INIT_ZEROS",
    "ROWWISE_ADAGRAD",
    "SGD",
    "apply_row_jit",
    "apply_rows_at_jit",
    "apply_rows_jit",
    "copy_rows_jit",
    "finite_rows_jit",
    "init_row_jit",
    "init_rows_jit",
    "put_rows_jit",
    "shard_of_jit",
    "shard_order_jit",
]
