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
class StepRows:
    """The embedding rows one micro-batch uses, gathered by :meth:`PlanExecutor.lookup`.

    Attributes:
        rows: float32 [n, dim] leaf tensor on the training device; after backward its
            ``grad`` is the micro-batch's gradient of each row.
        uniq: uint64 [n]: the ids, table by table, each table's ids sorted.
        bounds: int64 [T + 1]: table t's ids are ``uniq[bounds[t]:bounds[t + 1]]``.
        slots: int64 [n]: each row's cache slot when every row came from the cache, else None.
        removals: the cache's ``removals`` when ``slots`` were found.
    """

    rows: torch.Tensor
    uniq: np.ndarray
    bounds: np.ndarray
    slots: np.ndarray | None = None
    removals: int = -1

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
