"""Building micro-batches: a global batch's rows -> one :class:`MicroBatch` per worker.

The layout and its wire codec are the contract :mod:`herald.contracts.microbatch` (NOTE
[micro-batch layout]); this module fills it from a
:class:`~herald.loader.batch.SampleBatch` with the dispatcher's numba kernels
(:mod:`herald.dispatch.kernels`): per table the *unique* ids and an inverse index
(Persia §4.2.3's lossless compression), for several micro-batches in one pass.
"""

from __future__ import annotations

import numpy as np

from herald.contracts.microbatch import MicroBatch
from herald.contracts.plan import CachePlan, KeySet
from herald.dispatch.kernels import build_ranks_jit, count_rank_nnz_jit
from herald.errors import DataError
from herald.loader.batch import SampleBatch


def build_microbatch(
    step: int,
    rank: int,
    batch: SampleBatch,
    sample_ids: np.ndarray,
    plan: CachePlan,
    replicated: KeySet | None = None,
    pull_early: np.ndarray | None = None,
    index: np.ndarray | None = None,
) -> MicroBatch:
    """Compress ``batch`` (this worker's samples; or its rows ``index``, int [b],
    repeats allowed) into unique ids + inverse index: the :class:`MicroBatch` of worker
    ``rank`` at ``step`` with ``sample_ids`` uint64 [b], ``plan`` and (optional)
    ``replicated`` keys and ``pull_early`` bool [len(plan.pull)].

    Raises:
        DataError: an index out of range (as :meth:`SampleBatch.take`).
    """
    if index is None:
        index = np.arange(len(batch), dtype=np.int64)
    else:
        index = np.asarray(index, dtype=np.int64)
        n = len(batch)
        if index.size and (index.min() < -n or index.max() >= n):
            raise DataError(f"build: index out of range for a batch of {n} samples")
        index = np.where(index < 0, index + n, index)
    parts = build_parts(batch, index, np.array([0, index.shape[0]], np.int64))[0]
    return MicroBatch(
        step,
        rank,
        sample_ids,
        batch.labels[index],
        batch.dense[index],
        *parts,
        plan,
        replicated if replicated is not None else KeySet.empty(),
        pull_early,
    )


def build_parts(batch: SampleBatch, order: np.ndarray, wstart: np.ndarray) -> list[tuple]:
    """The id arrays of several micro-batches of ``batch`` in one kernel pass.

    Args:
        batch: the global batch; order: int64 [M] its rows (in ``[0, B)``) grouped by
            micro-batch; wstart: int64 [W+1]: micro-batch w has rows ``order[wstart[w]:wstart[w+1]]``.

    Returns:
        per micro-batch ``(ids_flat, id_bounds, inverse_flat, offsets_flat)`` of NOTE
        [micro-batch layout]: views of a few buffers shared by the micro-batches.
    """
    T, W = batch.num_tables, wstart.shape[0] - 1
    B = len(batch)
    values = (np.concatenate(batch.values) if T else np.zeros(0, np.uint64)).astype(np.uint64, copy=False)
    vbounds = np.zeros(T + 1, np.int64)
    np.cumsum([v.shape[0] for v in batch.values], out=vbounds[1:])
    offsets = np.stack(batch.offsets).astype(np.int64, copy=False) if T else np.zeros((0, B + 1), np.int64)
    nnz = np.empty((W, T), np.int64)
    count_rank_nnz_jit(order, wstart, offsets, nnz)
    total = int(nnz.sum())
    inv = np.empty(total, np.int32)
    uniq = np.empty(total, np.uint64)
    offs = np.empty(T * (order.shape[0] + W), np.int64)
    ubounds = np.empty((W, T + 1), np.int64)
    build_ranks_jit(order, wstart, values, vbounds, offsets, nnz, inv, uniq, offs, ubounds)
    rank_total = nnz.sum(axis=1).tolist()
    small = (nnz < 65536).all(axis=1).tolist()
    out, base = [], 0
    for w in range(W):
        n, lo, b = rank_total[w], int(wstart[w]), int(wstart[w + 1] - wstart[w])
        ub = ubounds[w]
        i = inv[base : base + n]
        orow = T * (lo + w)
        out.append(
            (
                uniq[base : base + int(ub[-1])],
                ub,
                i.astype(np.uint16) if small[w] else i,
                offs[orow : orow + T * (b + 1)].reshape(T, b + 1),
            )
        )
        base += n
    return out
