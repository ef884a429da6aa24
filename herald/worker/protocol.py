"""The consistency-protocol seam: what a worker pulls before forward, what it pushes
after backward, and when a step may start.

A :class:`ConsistencyProtocol` orders the operations of the :class:`~herald.worker.
executor.PlanExecutor` for one micro-batch; the worker runtime (:mod:`herald.worker.api`)
calls :meth:`~ConsistencyProtocol.before_forward` when a micro-batch arrives and
:meth:`~ConsistencyProtocol.after_backward` from ``step()``, then synchronises the dense
model and acks. A relaxed mode (HET bounded staleness, Persia hybrid, GBA) is another
implementation, found by the mode's name in the worker's registry :data:`herald.worker.modes.PROTOCOLS`
(docs/consistency.md, "Adding a mode"). :meth:`ConsistencyProtocol.make_dense`
gives the runtime the dense side of the protocol (:class:`~herald.worker.dense.DenseSync`
unless the mode synchronises the dense model otherwise, as GBA does).

:class:`BSP` is the exact protocol: NOTE [step protocol] in ``herald/contracts/plan.py``.
A BSP step may start as soon as its micro-batch arrives: the dispatcher sends step
``t + 1`` only within its credit window, and the dense all-reduce of step ``t`` (which
every worker enters after its pushes and write-backs of step ``t`` were acknowledged)
orders every push of step ``t`` before any pull of step ``t + 1`` that the step may
change. Pulls it cannot change are issued early, while step ``t`` computes
(:meth:`ConsistencyProtocol.prefetch`, NOTE [early pulls] in herald/dispatch/early.py).
"""

from __future__ import annotations

import abc
import collections

import numpy as np
import torch
from torch import nn

from herald.contracts.consistency import ModeSettings
from herald.contracts.microbatch import MicroBatch
from herald.contracts.modes import BspSettings
from herald.contracts.plan import KeySet
from herald.worker.dense import DenseState, DenseSync
from herald.worker.executor import PlanExecutor
from herald.worker.rows import StepRows


class ConsistencyProtocol(abc.ABC):
    """Orders a worker's embedding reads and writes around forward/backward.

    Args:
        executor: the worker's :class:`PlanExecutor`.

    Attributes:
        stats: this step's read counters (:meth:`take_stats`): ``reads`` (embedding rows
            read), ``stale_reads`` (rows read behind the PS copy), ``gap_sum`` and ``gap_max``
            (their clock gaps, updates behind), ``rereads`` (cached copies re-fetched because
            the staleness bound was reached), ``dropped`` (updates dropped or decayed).
    """

    name: str = ""
    #: whether the protocol ends each step with step messages (NOTE [step messages] in
    #: herald/ps/stepped.py): they order its PS writes, so the runtime may start the dense
    #: all-reduce before :meth:`after_backward`, and it waits for a next micro-batch that
    #: follows directly (``MicroBatch.next_follows``) so that its pulls ride along
    step_messages: bool = False

    def __init__(self, executor: PlanExecutor):
        self.executor = executor
        self.stats: collections.Counter = collections.Counter()

    @classmethod
    def for_settings(cls, executor: PlanExecutor, settings: ModeSettings) -> ConsistencyProtocol:
        """The protocol over ``executor`` with the mode's ``settings`` (the job's ``mode``, a
        :class:`~herald.contracts.consistency.ModeSettings` of this protocol's mode); default:
        ``cls(executor)``, a mode without settings."""
        return cls(executor)

    def count_reads(self, mb: MicroBatch, gaps: np.ndarray) -> None:
        """Count the rows ``mb`` reads; ``gaps``: uint64 clock gaps of those read stale."""
        self.stats["reads"] += int(mb.ids_flat.shape[0])
        self.stats["stale_reads"] += int(gaps.shape[0])
        if gaps.shape[0]:
            self.stats["gap_sum"] += int(gaps.sum())
            self.stats["gap_max"] = max(self.stats["gap_max"], int(gaps.max()))

    def take_stats(self) -> dict[str, int]:
        """The counters since the last call (then reset); sent with the ack."""
        out = {k: int(v) for k, v in self.stats.items()}
        self.stats.clear()
        return out

    def warm_arrays(self) -> dict[str, np.ndarray]:
        """The protocol's state of the cached copies by name, saved with the cache at a
        checkpoint off the grid (NOTE [warm resume] in herald/dispatch/warm.py); default none."""
        return {}

    def load_warm_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Take back :meth:`warm_arrays` (the cache's slots restored already); default: nothing."""
        return None

    def prefetch(self, mb: MicroBatch) -> None:
        """Start reading what ``mb`` (the next micro-batch, received while the current step
        runs) may read before the current step's updates land; default: nothing."""
        return None

    def lookup(self, mb: MicroBatch) -> tuple:
        """Sum-pooled embeddings of ``mb`` (float32 [b, T, dim]) and the :class:`StepRows` whose
        gradient :meth:`after_backward` reads; default: the cache's (:meth:`PlanExecutor.lookup`)."""
        return self.executor.lookup(mb)

    def ack_arrays(self) -> list[np.ndarray]:
        """Arrays sent with this step's ack after the predictions (then forgotten); default none
        (hybrid: the gradients by sample id, NOTE [hybrid training] in herald/dispatch/hybrid.py)."""
        return []

    def flush(self, keys: KeySet, reset: bool) -> None:
        """Write back the only-latest rows ``keys``; with ``reset`` empty the cache (NOTE
        [checkpoint barrier] in herald/dispatch/dispatcher.py)."""
        self.executor.flush(keys, reset)

    def make_dense(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        world_size: int,
        rank: int = 0,
        dense_comm: str = "fp32",
        groups: int = 1,
        average_every: int = 10,
        easgd_alpha: float = 0.3,
    ) -> DenseState:
        """The dense side of the protocol for ``model`` and its ``optimizer`` (called once by
        ``ScheduledLoader.attach``); default: :class:`~herald.worker.dense.DenseSync`, the
        all-reduce of NOTE [step protocol] step 7 over ``world_size`` ranks (its arguments)."""
        return DenseSync(
            model,
            optimizer,
            world_size,
            dense_comm=dense_comm,
            rank=rank,
            groups=groups,
            average_every=average_every,
            easgd_alpha=easgd_alpha,
        )

    @abc.abstractmethod
    def before_forward(self, mb: MicroBatch) -> None:
        """Make every row ``mb`` reads valid in the cache (evictions, pulls)."""

    @abc.abstractmethod
    def after_backward(self, mb: MicroBatch, step_rows: StepRows) -> None:
        """Send or apply the embedding updates of ``mb`` (gradients in ``step_rows.rows.grad``)."""


class BSP(ConsistencyProtocol):
    """Bulk-synchronous, exact: NOTE [step protocol] steps 1-2 before forward, 4-6 after
    backward (step 7, the dense all-reduce, is the runtime's). Equals single-process
    training on the same global batches (Herald §3.3; tests/integration/test_train_exact.py).

    Steps 4-6 of step t, with steps 1-2 of t + 1 when its micro-batch is already here, go
    as one step message per shard (NOTE [step messages] in herald/ps/stepped.py): the
    shards order the writes of t before the pulls of t + 1, so the dense all-reduce may
    overlap the round trip (:attr:`step_messages`).
    """

    name = BspSettings.name
    step_messages = True

    def __init__(self, executor: PlanExecutor):
        super().__init__(executor)
        self._next: MicroBatch | None = None

    def prefetch(self, mb: MicroBatch) -> None:
        self._next = mb  # its evictions and pulls ride on this step's message

    def before_forward(self, mb: MicroBatch) -> None:
        if not self.executor.step_message.prepared(mb.step):  # not sent with the previous step's message
            self.executor.evict(mb.plan)  # 1. evict (write-backs acknowledged with this step's message)
            self.executor.pull(mb)  # 2. pull: every key used is now cached and latest
        self.executor.pull_replicas(mb)
        self.count_reads(mb, np.zeros(0, np.uint64))

    def after_backward(self, mb: MicroBatch, step_rows: StepRows) -> None:
        ex = self.executor
        grads = ex.gradients(step_rows)
        nxt = self._next if self._next is not None and self._next.step == mb.step + 1 else None
        self._next = None
        ex.step_message.send(mb, grads, step_rows, nxt)  # 4-6 of t (and 1-2 of t + 1): one message per shard
        ex.update_replicas(mb, grads, step_rows)
        ex.wait_writes()  # write-backs of a step that came without its message
        ex.step_message.finish()  # every rank's step-t writes applied: an ack means so

    def flush(self, keys: KeySet, reset: bool) -> None:
        self._next = None
        super().flush(keys, reset)
