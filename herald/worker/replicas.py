"""Replicated tables: small, hot embedding tables held whole by every worker.

NOTE [replicated tables] (docs/design.md, "Replicated tables"; the hybrid embeddings of
MLPerf DLRM, Persia §4.2's dense/sparse split taken one step further). A table with few
ids is used by nearly every sample, so under the PS protocol every worker pushes its
gradient and pulls the update of its hot rows every step. A replicated table instead
lives on every worker:

1. Before forward, every worker makes sure it holds every key of the step's *union*
   (the replicated keys any worker uses this step, sent identically to all ranks);
   a key it never held is pulled from the PS once (its latest copy is there).
2. After backward, each worker scatters its gradient (already divided by the number
   of workers) into a ``[len(union), dim]`` buffer, zeros elsewhere; the buffers are
   summed by all-reduce (the dense parameters' group, or its gloo side group for these
   CPU tensors when that group is NCCL: NOTE [worker devices]) and
   every worker applies the sparse optimizer (the PS's kernel) to the union rows.
   Every replica receives the same sum and the same kernel: the replicas stay equal,
   and each key gets one optimizer application per step with the full gradient
   (exact BSP, as for the PS protocol).
3. At a flush (end of training, checkpoint barrier) rank 0 writes every replicated row
   back to the PS, so the PS holds the whole model; a barrier with reset then empties
   every replica, and the next step pulls again, exactly as a restarted job would.

The scheduler never sees replicated tables (the dispatcher empties them in the batch
it schedules), so they cost no cache slots, pulls or pushes in its accounting; the
all-reduce payload is reported separately.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from herald.contracts.plan import KeySet
from herald.contracts.tables import TableConfig
from herald.ps import PSClient, apply_gradients
from herald.worker import psio
from herald.worker.cache import EmbeddingCache
from herald.worker.devices import group_for


class ReplicaStore:
    """Every worker's copy of the replicated tables (NOTE [replicated tables]).

    Args:
        capacity_rows: most distinct replicated keys (the pre-pass counts them).
        row_width: floats per row (embedding + optimizer state).
        dim: embedding dimension.
        tables: every table's config (indexed by table index).
        ps: the worker's PS client.
        world_size: number of workers (all-reduce only when > 1).
    """

    def __init__(
        self, capacity_rows: int, row_width: int, dim: int, tables: list[TableConfig], ps: PSClient, world_size: int
    ):
        self._args = (capacity_rows, row_width)
        self.store = EmbeddingCache(capacity_rows, row_width)
        self.dim, self.tables, self.ps, self.world_size = dim, tables, ps, world_size

    def ensure(self, union: KeySet) -> None:
        """Step 1: pull the union keys this replica lacks."""
        if not len(union):
            return
        missing = self.store.slots(union, must_exist=False) < 0
        if not missing.any():
            return
        need = KeySet(union.table[missing], union.ids[missing])
        self.store.put(need, psio.pull_keys(self.ps, need, self.store.row_width))

    def rows(self, keys: KeySet) -> np.ndarray:
        """float32 [n, dim]: the embeddings of ``keys`` (all held after :meth:`ensure`)."""
        return self.store.rows[self.store.slots(keys), : self.dim]

    def update(self, union: KeySet, keys: KeySet, grads: np.ndarray) -> int:
        """Step 2: all-reduce this worker's ``grads`` (float32 [len(keys), dim], for its
        ``keys``, a subset of ``union``) and apply the optimizer to every union row.
        Returns the all-reduce payload in bytes."""
        if not len(union):
            return 0
        buf = np.zeros((len(union), self.dim), np.float32)
        if len(keys):
            bounds = np.searchsorted(union.table, np.arange(len(self.tables) + 1, dtype=np.int32))
            buf[psio.positions(union.ids, bounds, keys)] = grads
        if self.world_size > 1:
            summed = torch.from_numpy(buf)  # a CPU tensor: the gloo side group under NCCL (NOTE [worker devices])
            dist.all_reduce(summed, group=group_for(summed))
            buf = summed.numpy()
        slots = self.store.slots(union)
        for t, m in psio.table_groups(union.table):  # each table at its own width (NOTE [mixed widths])
            table = self.tables[t]
            local = np.ascontiguousarray(self.store.rows[slots[m], : table.row_width])
            apply_gradients(local, np.ascontiguousarray(buf[m, : table.dim]), table)
            self.store.rows[slots[m], : table.row_width] = local
        return buf.nbytes

    def write_back(self) -> None:
        """Step 3: push every replicated row to the PS (call on one rank)."""
        keys = self.store.key_set()
        psio.push_rows(self.ps, keys, self.store.rows[self.store.slots(keys)])

    def clear(self) -> None:
        """Forget every row (after a write-back at a checkpoint barrier with reset)."""
        self.store = EmbeddingCache(*self._args)
