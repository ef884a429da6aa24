"""What the plan executor moves: a step's rows and gradients, what a pull fetched, the PS
read and write functions a protocol may pass it (:data:`Fetch`, :data:`Write`), and the
sum-pooling of a micro-batch's bags (:func:`pool_bags`). Used by
:class:`~herald.worker.executor.PlanExecutor` and the consistency protocols.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from herald.contracts.plan import KeySet
from herald.worker import psio


@dataclasses.dataclass
class StepKeys:
    """The distinct keys a micro-batch reads, table by table, and where each of its values reads.

    Attributes:
        keys: the (table, id) keys, table after table, each table's ids sorted and distinct
            (features that read one table share its keys: NOTE [tables and features] in
            herald/contracts/features.py).
        bounds: int64 [tables + 1]: table t's keys are ``keys[bounds[t]:bounds[t + 1]]``.
        value_rows: int64 [N]: the key (row) of each value of the micro-batch, feature after
            feature, bag after bag (``MicroBatch.inverse_flat``'s order).
    """

    keys: KeySet
    bounds: np.ndarray
    value_rows: np.ndarray


def step_keys(mb, feature_tables: np.ndarray | None, num_tables: int) -> StepKeys:
    """The :class:`StepKeys` of micro-batch ``mb``.

    Args:
        mb: a :class:`~herald.contracts.microbatch.MicroBatch` (its features' distinct ids,
            ``id_bounds``, ``inverse_flat``, ``inverse_bounds``).
        feature_tables: int [T]: the table of each feature (``JobSpec.feature_tables``), or
            None when feature t reads table t (then the micro-batch's ids serve as they are).
        num_tables: the job's tables.
    """
    ids_bounds = np.ascontiguousarray(mb.id_bounds, dtype=np.int64)
    nnz = np.diff(mb.inverse_bounds)
    inputs = mb.inverse_flat.astype(np.int64)  # index of each value among its feature's distinct ids
    if feature_tables is None:
        uniq = mb.ids_flat.copy()  # writable (the message's blob is not): one numba signature for its kernels
        keys = KeySet(np.repeat(np.arange(mb.num_tables, dtype=np.int32), np.diff(ids_bounds)), uniq)
        inputs += np.repeat(ids_bounds[:-1], nnz)
        return StepKeys(keys, ids_bounds, inputs)
    tables, ids, where = [], [], np.empty(mb.ids_flat.shape[0], np.int64)
    bounds = np.zeros(num_tables + 1, np.int64)
    for t in range(num_tables):  # each table: the union of its features' distinct ids
        feats = np.flatnonzero(feature_tables == t)
        parts = [mb.ids_flat[ids_bounds[f] : ids_bounds[f + 1]] for f in feats]
        merged, back = np.unique(np.concatenate(parts) if parts else np.zeros(0, np.uint64), return_inverse=True)
        start = bounds[t]
        at = 0
        for f in feats:
            n = int(ids_bounds[f + 1] - ids_bounds[f])
            where[ids_bounds[f] : ids_bounds[f + 1]] = start + back[at : at + n]
            at += n
        bounds[t + 1] = start + merged.shape[0]
        tables.append(np.full(merged.shape[0], t, np.int32))
        ids.append(merged.astype(np.uint64, copy=False))
    keys = KeySet(np.concatenate(tables), np.concatenate(ids))
    inputs += np.repeat(ids_bounds[:-1], nnz)  # index among the micro-batch's (feature, id) entries
    return StepKeys(keys, bounds, where[inputs])


@dataclasses.dataclass
class StepRows:
    """The embedding rows one micro-batch uses, gathered by :meth:`PlanExecutor.lookup`.

    Attributes:
        rows: float32 [n, dim] leaf tensor on the training device; after backward its
            ``grad`` is the micro-batch's gradient of each row.
        uniq: uint64 [n]: the ids, table by table, each table's ids sorted.
        bounds: int64 [T + 1]: table t's ids are ``uniq[bounds[t]:bounds[t + 1]]``.
        slots: int64 [n]: each row's cache slot when every row came from the cache, else None.
        removals: the cache's ``removals`` when ``slots`` were found.
        value_rows: int64 [N]: the row of each value of the micro-batch (:class:`StepKeys`),
            what a sequence feature reads (None where the rows are pooled bags: hybrid).
    """

    rows: torch.Tensor
    uniq: np.ndarray
    bounds: np.ndarray
    slots: np.ndarray | None = None
    removals: int = -1
    value_rows: np.ndarray | None = None

    def tables(self) -> np.ndarray:
        """int32 [n]: the table of each row."""
        return np.repeat(np.arange(self.bounds.shape[0] - 1, dtype=np.int32), np.diff(self.bounds))

    def positions(self, keys: KeySet) -> np.ndarray:
        """int64 [len(keys)]: the row of each key (:class:`ProtocolError` if one is missing)."""
        return psio.positions(self.uniq, self.bounds, keys)

    def cache_slots(self, cache, at: np.ndarray) -> np.ndarray | None:
        """The cache slots of rows ``at`` (int64 [m]) as found at the lookup, while no key
        has left ``cache`` since (its slots are then unchanged); else None: look them up."""
        return self.slots[at] if self.slots is not None and cache.removals == self.removals else None


@dataclasses.dataclass
class StepGrads:
    """The gradients of a step's rows, divided by the number of workers (:meth:`PlanExecutor.gradients`).

    Attributes:
        tensor: float32 [n, dim] on the training device (row i is ``StepRows.rows[i]``'s).
    """

    tensor: torch.Tensor
    _host: np.ndarray | None = None

    def host(self) -> np.ndarray:
        """float32 [n, dim] numpy: every row (one device-to-host copy per step at most)."""
        if self._host is None:
            self._host = self.tensor.to("cpu").numpy()
        return self._host

    def host_rows(self, at: np.ndarray) -> np.ndarray:
        """float32 [len(at), dim] numpy: rows ``at`` (int64), copying only them off a GPU."""
        if self._host is not None or self.tensor.device.type == "cpu":
            return np.take(self.host(), at, axis=0)
        index = torch.from_numpy(np.ascontiguousarray(at, dtype=np.int64)).to(self.tensor.device)
        return self.tensor.index_select(0, index).to("cpu").numpy()


#: ``fetch(keys, at) -> wait``: start reading the rows of ``keys``, the pulls ``at`` (bool
#: [len(plan.pull)]) of a plan, from the PS; ``wait()`` gives a :class:`~herald.worker.psio.Fetched`
#: in key order. The executor's own reads all of them (:func:`herald.worker.psio.fetch_async`).
Fetch = Callable[[KeySet, np.ndarray], Callable[[], psio.Fetched]]
#: ``write(keys, rows) -> handle``: start writing ``rows`` (float32 [len(keys), row_width]) of
#: ``keys`` to the PS; the handle's ``wait()`` acknowledges it (None for no keys). The
#: executor's own: :func:`herald.worker.psio.push_rows_async`.
Write = Callable[[KeySet, np.ndarray], Any]


@dataclasses.dataclass
class Pulled:
    """What :meth:`PlanExecutor.pull` fetched.

    Attributes:
        keys: the keys whose rows came (now in the cache), in plan order.
        fetched: bool [len(plan.pull)]: which pulls those are (False: the fetch left a copy
            that is still valid in the cache).
        clocks: uint64 [len(plan.pull)]: the fetch's clocks (:class:`~herald.worker.psio.Fetched`;
            NOTE [clock frames]), 0 elsewhere.
    """

    keys: KeySet
    fetched: np.ndarray
    clocks: np.ndarray


def pool_bags(
    rows: torch.Tensor, inputs: np.ndarray, offsets_flat: np.ndarray, inverse_bounds: np.ndarray, device: torch.device
) -> torch.Tensor:
    """Sum-pool the bags of a micro-batch: float32 [T x b, dim], bag ``(t, i)`` at row ``t * b + i``.

    Args:
        rows: float32 [n, dim] on ``device`` (requires grad): the step's distinct rows.
        inputs: int64 [N]: the row of each value, table after table.
        offsets_flat: int64 [T, b + 1]: table t's bag i holds its values ``offsets[t, i]:offsets[t, i + 1]``.
        inverse_bounds: int64 [T + 1]: table t's values start at ``inverse_bounds[t]`` in ``inputs``.

    On the CPU the bags are pooled by ``index_select`` (+ ``index_add`` unless every bag
    holds exactly one value): the forward is ``F.embedding_bag(mode="sum")``'s to the
    bit (values added in bag order), the backward adds each row's gradients in value
    order, and both cost about a third of ``embedding_bag``'s sorting backward (measured
    at 26 tables x 256 samples). Elsewhere (CUDA's ``index_add`` uses atomics, whose
    order varies) it is ``F.embedding_bag``.
    """
    t, b1 = offsets_flat.shape
    bags = t * (b1 - 1)
    index = torch.from_numpy(inputs).to(device)
    if device.type != "cpu":
        starts = (offsets_flat[:, :-1] + inverse_bounds[:-1, None]).reshape(-1)
        return F.embedding_bag(index, rows, torch.from_numpy(starts).to(device), mode="sum")
    values = rows.index_select(0, index)
    lengths = np.diff(offsets_flat, axis=1).reshape(-1)
    if inputs.shape[0] == bags and bool((lengths == 1).all()):  # one value per bag: the values are the bags
        return values
    bag_of_value = torch.from_numpy(np.repeat(np.arange(bags, dtype=np.int64), lengths))
    return torch.zeros((bags, rows.shape[1]), dtype=rows.dtype).index_add(0, bag_of_value, values)
