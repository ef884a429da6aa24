"""Micro-batches: one worker's share of a global batch, with its cache plan.

Built by the dispatcher from the scheduler's allocation, sent over ZeroMQ with
:mod:`herald.wire`, rebuilt by the worker. Per table the micro-batch carries the
*unique* ids and an inverse index (Persia §4.2.3's lossless compression: uint16
when the table has fewer than 65,536 values in the micro-batch, else int32), so
the worker gathers each embedding once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from herald.errors import ProtocolError
from herald.loader.batch import SampleBatch
from herald.scheduler.plan import CachePlan, KeySet
from herald.worker.kernels import segment_unique_jit

#: sample id = dispatcher rank in the top 8 bits, sequence number below (Persia §4.1).
SAMPLE_ID_RANK_SHIFT = 56
SAMPLE_ID_SEQ_MASK = (1 << SAMPLE_ID_RANK_SHIFT) - 1


def make_sample_ids(dispatcher_rank: int, first_seq: int, n: int) -> np.ndarray:
    """uint64 [n] sample ids ``rank << 56 | (first_seq + i)``.

    Raises:
        ProtocolError: rank outside [0, 255] or the sequence number overflows 56 bits.
    """
    if not 0 <= dispatcher_rank < 256:
        raise ProtocolError(f"dispatcher rank must be in [0, 255], got {dispatcher_rank}")
    if first_seq + n > SAMPLE_ID_SEQ_MASK:
        raise ProtocolError("sample sequence number exceeds 56 bits")
    seq = np.arange(first_seq, first_seq + n, dtype=np.uint64)
    return seq | np.uint64(dispatcher_rank << SAMPLE_ID_RANK_SHIFT)


@dataclasses.dataclass
class MicroBatch:
    """Worker ``rank``'s samples at ``step``.

    Attributes:
        step: global step index (0-based).
        rank: worker rank.
        sample_ids: uint64 [b].
        labels: float32 [b]; dense: float32 [b, D].
        unique_ids: per table, uint64 [u_t] distinct ids of the micro-batch.
        inverse: per table, uint16 or int32 [nnz_t]: value j of the table is
            ``unique_ids[t][inverse[t][j]]``.
        offsets: per table, int64 [b+1] (as in :class:`SampleBatch`).
        plan: the worker's :class:`CachePlan` for this step.
        replicated: the keys of replicated tables that any worker uses this step,
            sorted by (table, id) and equal on every rank: the rows all-reduced and
            updated on every replica (docs/design.md, "Replicated tables").
    """

    step: int
    rank: int
    sample_ids: np.ndarray
    labels: np.ndarray
    dense: np.ndarray
    unique_ids: list[np.ndarray]
    inverse: list[np.ndarray]
    offsets: list[np.ndarray]
    plan: CachePlan
    replicated: KeySet = dataclasses.field(default_factory=KeySet.empty)
    #: bool [len(plan.pull)]: the PS copy of this key is final before the previous step's
    #: pushes (NOTE [early pulls] in herald/dispatch/dispatcher.py); all False (wait) by default
    pull_early: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.pull_early is None:
            self.pull_early = np.zeros(len(self.plan.pull), bool)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_tables(self) -> int:
        return len(self.unique_ids)

    @classmethod
    def build(cls, step: int, rank: int, batch: SampleBatch, sample_ids: np.ndarray, plan: CachePlan,
              replicated: KeySet | None = None, pull_early: np.ndarray | None = None) -> "MicroBatch":
        """Compress ``batch`` (this worker's samples) into unique ids + inverse index."""
        # one kernel call for all tables (np.unique per table costs ~12 us of Python each)
        lengths = [v.shape[0] for v in batch.values]
        bounds = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=bounds[1:])
        values = (np.concatenate(batch.values) if lengths else np.zeros(0, np.uint64)).astype(np.uint64, copy=False)
        flat_u = np.empty(values.shape[0], np.uint64)
        flat_i = np.empty(values.shape[0], np.int64)
        u_bounds = np.empty(len(lengths) + 1, np.int64)
        segment_unique_jit(values, bounds, flat_u, flat_i, u_bounds)
        uniq, inv = [], []
        for t, n in enumerate(lengths):
            uniq.append(flat_u[u_bounds[t]: u_bounds[t + 1]].copy())
            inv.append(flat_i[bounds[t]: bounds[t + 1]].astype(np.uint16 if n < 65536 else np.int32))
        return cls(step, rank, sample_ids, batch.labels, batch.dense, uniq, inv, list(batch.offsets), plan,
                   replicated if replicated is not None else KeySet.empty(), pull_early)

    def values(self, table: int) -> np.ndarray:
        """uint64 [nnz_t]: the table's ids per sample, decompressed."""
        return self.unique_ids[table][self.inverse[table]]

    # ------------------------------------------------------------------ wire
    def to_frames(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Header and arrays for :func:`herald.wire.pack` (op ``microbatch``)."""
        p = self.plan
        arrays = [self.sample_ids, self.labels, self.dense]
        for u, i, o in zip(self.unique_ids, self.inverse, self.offsets):
            arrays += [u, i, o]
        arrays += [p.evict.table, p.evict.ids, p.write_back.astype(np.bool_), p.pull.table, p.pull.ids,
                   p.grad_push.table, p.grad_push.ids, p.contributors.astype(np.uint16),
                   p.update_local.table, p.update_local.ids, p.plan_push.table, p.plan_push.ids,
                   self.replicated.table, self.replicated.ids, self.pull_early.astype(np.bool_)]
        header = {"op": "microbatch", "step": self.step, "rank": self.rank, "tables": self.num_tables}
        return header, arrays

    @classmethod
    def from_frames(cls, header: dict[str, Any], arrays: list[np.ndarray]) -> "MicroBatch":
        """Rebuild from :func:`herald.wire.unpack` output.

        Raises:
            ProtocolError: the arrays do not form a micro-batch (count, dtype or length).
        """
        t = header.get("tables")
        if not isinstance(t, int) or t < 0 or len(arrays) != 3 + 3 * t + 15:
            raise ProtocolError(f"microbatch: expected {3 + 3 * (t or 0) + 15} arrays for {t} tables, got {len(arrays)}")
        sample_ids, labels, dense = arrays[:3]
        b = labels.shape[0]
        _check(sample_ids.dtype == np.uint64 and sample_ids.shape == (b,), "sample_ids must be uint64 [b]")
        _check(labels.dtype == np.float32 and dense.dtype == np.float32 and dense.ndim == 2 and dense.shape[0] == b,
               "labels/dense must be float32 [b] / [b, D]")
        uniq, inv, offs = [], [], []
        for k in range(t):
            u, i, o = arrays[3 + 3 * k: 6 + 3 * k]
            _check(u.dtype == np.uint64 and i.dtype in (np.uint16, np.int32) and o.dtype == np.int64
                   and o.shape == (b + 1,) and int(o[-1]) == i.shape[0], f"table {k}: bad ids/inverse/offsets")
            if i.shape[0] and (int(i.max()) >= u.shape[0] or int(i.min()) < 0):
                raise ProtocolError(f"table {k}: inverse index out of range")
            uniq.append(u), inv.append(i), offs.append(o)
        q = arrays[3 + 3 * t:]
        try:
            plan = CachePlan(KeySet(q[0], q[1]), q[2].astype(bool), KeySet(q[3], q[4]), KeySet(q[5], q[6]),
                             q[7], KeySet(q[8], q[9]), KeySet(q[10], q[11]))
            replicated = KeySet(q[12], q[13])
            pull_early = q[14].astype(bool)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"microbatch plan: {exc}") from None
        _check(plan.write_back.shape == plan.evict.ids.shape and plan.contributors.shape == plan.grad_push.ids.shape,
               "plan: write_back/contributors lengths must match evict/grad_push")
        _check(pull_early.shape == plan.pull.ids.shape, "plan: pull_early length must match pull")
        return cls(int(header.get("step", -1)), int(header.get("rank", -1)), sample_ids, labels, dense,
                   uniq, inv, offs, plan, replicated, pull_early)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ProtocolError(f"microbatch: {message}")
