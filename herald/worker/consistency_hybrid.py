"""Persia hybrid training on the worker: embeddings read without waiting, gradients sent by sample id.

The worker's half of NOTE [hybrid training] (herald/dispatch/hybrid.py; Persia §3,
Alg. 1, and §4.2): the worker holds no embedding rows. When a micro-batch arrives
(:meth:`Hybrid.prefetch`, while the step before still computes, or at the latest in
:meth:`Hybrid.before_forward`) it pulls every row the micro-batch reads from the PS, without
waiting for earlier steps' embedding updates and without writing the cache; the plan is
not executed. :meth:`Hybrid.lookup` sum-pools those rows (the same ``embedding_bag`` as the
cache lookup, so the forward values are the same as BSP's for the same rows) into a leaf
tensor float32 [b, T, dim]; after backward its gradient, divided by the number of workers
(docs/design.md, "Loss scaling"), goes back with the ack together with the sample ids
(:meth:`Hybrid.ack_arrays`): the dispatcher expands, sums and pushes it. The worker never
waits for its gradients to be applied; the dense all-reduce stays synchronous.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from herald.contracts.microbatch import MicroBatch
from herald.contracts.modes import HybridSettings
from herald.contracts.plan import KeySet
from herald.errors import ProtocolError
from herald.worker import psio
from herald.worker.executor import PlanExecutor
from herald.worker.protocol import ConsistencyProtocol
from herald.worker.rows import StepRows


def step_keys(mb: MicroBatch) -> KeySet:
    """Every (table, id) ``mb`` reads: table after table, each table's ids sorted."""
    sizes = [u.shape[0] for u in mb.unique_ids]
    table = np.repeat(np.arange(mb.num_tables, dtype=np.int32), sizes)
    return KeySet(table, np.concatenate(mb.unique_ids) if mb.num_tables else np.zeros(0, np.uint64))


def pool(mb: MicroBatch, emb: torch.Tensor) -> torch.Tensor:
    """Sum-pool ``emb`` (float32 [n, dim], the rows of :func:`step_keys` in order) into the
    bags of ``mb``: float32 [b, T, dim] (as :meth:`PlanExecutor.lookup` does)."""
    sizes = np.array([u.shape[0] for u in mb.unique_ids], np.int64)
    bounds = np.zeros(mb.num_tables + 1, np.int64)
    np.cumsum(sizes, out=bounds[1:])
    nnz = np.array([i.shape[0] for i in mb.inverse], np.int64)
    nnz_base = np.zeros(mb.num_tables, np.int64)
    np.cumsum(nnz[:-1], out=nnz_base[1:])
    inputs = np.concatenate(mb.inverse).astype(np.int64)
    inputs += np.repeat(bounds[:-1], nnz)
    bags = np.concatenate([o[:-1] for o in mb.offsets])
    bags += np.repeat(nnz_base, len(mb))
    dev = emb.device
    pooled = F.embedding_bag(torch.from_numpy(inputs).to(dev), emb, torch.from_numpy(bags).to(dev), mode="sum")
    return pooled.view(mb.num_tables, len(mb), emb.shape[1]).transpose(0, 1)


class Hybrid(ConsistencyProtocol):
    """Asynchronous embeddings, synchronous dense: NOTE [hybrid training] (Persia §3-4).

    Args:
        executor: the worker's :class:`PlanExecutor` (its PS client and timer; its cache is not used).
    """

    name = HybridSettings.name

    def __init__(self, executor: PlanExecutor):
        super().__init__(executor)
        self._reads: dict[int, tuple[KeySet, object]] = {}  # step -> (keys, wait()): pulls in flight
        self._rows: tuple[int, KeySet, np.ndarray] | None = None  # (step, keys, rows) of the current step
        self._out: list[np.ndarray] = []
        self._divisor = torch.tensor(float(executor.world_size), dtype=torch.float32, device=executor.device)

    def prefetch(self, mb: MicroBatch) -> None:
        """Start pulling every row ``mb`` reads (no ordering: NOTE [hybrid training] 2)."""
        if mb.step not in self._reads and mb.num_tables:
            keys = step_keys(mb)
            self._reads[mb.step] = (keys, psio.pull_keys_async(self.executor.ps, keys, self.executor.cache.row_width))

    def before_forward(self, mb: MicroBatch) -> None:
        ex = self.executor
        self.prefetch(mb)
        keys, wait = self._reads.pop(mb.step)
        with ex.timer("pull"):
            rows = wait()
        ex.bytes_pulled += rows.nbytes + keys.ids.nbytes
        self._rows = (mb.step, keys, rows)
        self.count_reads(mb, np.zeros(0, np.uint64))

    def lookup(self, mb: MicroBatch) -> tuple[torch.Tensor, StepRows]:
        """The pooled bags float32 [b, T, dim] as a leaf tensor (its gradient is what the
        dispatcher gets), and :class:`StepRows` whose ``rows`` is that leaf.

        Raises:
            ProtocolError: :meth:`before_forward` was not called for ``mb``.
        """
        ex = self.executor
        if self._rows is None or self._rows[0] != mb.step:
            raise ProtocolError(
                f"hybrid lookup of step {mb.step} before its rows were read (call the embedding "
                "once per batch yielded by the loader)"
            )
        _, keys, rows = self._rows
        with ex.timer("lookup"), torch.no_grad():
            emb = torch.from_numpy(np.ascontiguousarray(rows[:, : ex.dim])).to(ex.device)
            pooled = pool(mb, emb)
        leaf = pooled.detach().requires_grad_(True)
        bounds = np.zeros(mb.num_tables + 1, np.int64)
        np.cumsum([u.shape[0] for u in mb.unique_ids], out=bounds[1:])
        return leaf, StepRows(leaf, keys.ids, bounds)

    def after_backward(self, mb: MicroBatch, step_rows: StepRows) -> None:
        """Keep the bags' gradients by sample id for the ack (NOTE [hybrid training] 3)."""
        grad = step_rows.rows.grad
        with self.executor.timer("grad_push"):
            if grad is None:
                g = np.zeros(tuple(step_rows.rows.shape), np.float32)
            else:
                g = (grad.detach() / self._divisor).to("cpu", torch.float32).contiguous().numpy()
            self._out = [np.ascontiguousarray(mb.sample_ids, np.uint64), np.ascontiguousarray(g, np.float32)]
        self.executor.bytes_pushed += self._out[0].nbytes + self._out[1].nbytes
        self._rows = None

    def ack_arrays(self) -> list[np.ndarray]:
        out, self._out = self._out, []
        return out

    def flush(self, keys: KeySet, reset: bool) -> None:
        """Nothing to write back: a hybrid worker holds no embedding rows (the dispatcher drains
        its pushes before the barrier's checkpoint)."""
