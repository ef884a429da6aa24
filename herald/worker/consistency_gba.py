"""GBA on the worker: token-gated reads from the PS, one contribution per micro-batch.

The protocol is NOTE [gba tokens] in herald/ps/gba.py (GBA §4.1). A GBA worker
keeps no embedding between micro-batches and takes part in no collective:

- before forward: a ``gba_pull`` to every shard with the micro-batch's token ``tau``
  (the rows of its keys, answered once the shard's global step ``k >= tau - iota``;
  asked again while not, bounded by the PS timeout); shard 0's reply also carries the
  aggregated dense gradients of the global steps this worker has not replayed yet, which
  :class:`GbaDense` applies in order with the job's torch optimizer;
- after backward: one ``gba_push`` to every shard (possibly empty) with ``(tau, slot)``:
  the rows' gradients and, to shard 0, the flat dense gradient, each divided by ``M``;
  acknowledged before the ack to the dispatcher. Shard 0's reply gives the global step
  the contribution is applied at, hence its staleness ``k - tau`` and whether eq. (1)
  dropped it: the ``consistency`` counters of the ack (``contributions``, ``gap_sum``,
  ``gap_max``, ``dropped``).

The micro-batch's ``step`` is its index ``i`` in the data list: ``tau = i // M``,
``slot = i % M`` (herald/dispatch/gba.py).
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
import torch
from torch import nn

from herald.contracts.microbatch import MicroBatch
from herald.contracts.modes import GbaSettings
from herald.contracts.plan import KeySet
from herald.errors import ConfigError, DataError, PeerTimeout, ProtocolError
from herald.ps.rows import shard_of
from herald.worker import psio
from herald.worker.dense import DenseState
from herald.worker.executor import PlanExecutor
from herald.worker.protocol import ConsistencyProtocol
from herald.worker.rows import StepRows

#: Longest pause between two gated reads of a shard that is not ready yet, seconds.
MAX_RETRY_S = 0.004


class GbaDense(DenseState):
    """The dense model under GBA: no all-reduce; the PS aggregates (NOTE [gba tokens]).

    Stands where :class:`~herald.worker.dense.DenseSync` stands in the worker runtime; the
    same :class:`~herald.worker.dense.DenseState` (``model``, ``step()``, ``save()``,
    ``load()``, ``close()``; the same ``dense.pt``).

    Args:
        model: the dense model; optimizer: its torch optimizer (the job's, e.g. Adam).

    Attributes:
        next_step: the first global step whose aggregated dense gradient is not applied yet.
        start_step: the job's first global step (0, or a resumed checkpoint's next step).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer)
        self.size = int(sum(p.numel() for p in self.params))
        self.next_step = self.start_step = 0

    def flat_grad(self, divisor: torch.Tensor) -> np.ndarray:
        """float32 [P]: every parameter's gradient (0 where none) divided by ``divisor`` (M)."""
        if not self.params:
            return np.zeros(0, np.float32)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        return (flat.detach() / divisor).to("cpu", torch.float32).numpy()

    def replay(self, first: int, grads: np.ndarray, kept: np.ndarray) -> None:
        """Apply the aggregated dense gradients of global steps ``first ..``: float32 [n, P],
        one optimizer step each where ``kept`` (uint64 [n]) is not 0.

        Raises:
            ProtocolError: ``first`` is not :attr:`next_step` (a step would be skipped or repeated).
        """
        if first != self.next_step:
            raise ProtocolError(f"gba: dense steps from {first} received, {self.next_step} expected")
        for i in range(grads.shape[0]):
            if not kept[i]:
                continue
            flat = torch.from_numpy(np.array(grads[i], np.float32)).to(self.params[0].device)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
            self.optimizer.step()
        self.next_step = first + grads.shape[0]
        self.zero()

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self, summed: bool = False) -> None:
        """The runtime's dense step: the gradient already went to the PS with the contribution."""
        self.zero()

    def load(self, folder: str | pathlib.Path, device: torch.device) -> None:
        """Resume from a checkpoint folder (NOTE [gba checkpoints] in herald/dispatch/gba.py):
        the model and optimizer state of its ``dense.pt`` (written under BSP or GBA: the same
        format), and :attr:`next_step` = its ``meta.json``'s next global step, where the PS
        shards' buffers start (:attr:`start_step`).

        Raises:
            DataError: no readable ``dense.pt`` or ``meta.json`` with the dispatcher's next step.
        """
        folder = pathlib.Path(folder)
        try:
            state = self.read_state(folder, device)
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError, RuntimeError) as exc:
            raise DataError(
                f"gba --resume: checkpoint {folder} is unreadable ({exc}); delete it to start afresh"
            ) from None
        start = (meta.get("dispatcher") or {}).get("next_step") if isinstance(meta, dict) else None
        if type(start) is not int or start < 0:
            raise DataError(
                f"gba --resume: {folder / 'meta.json'} has no dispatcher next_step; delete the "
                "checkpoint to start afresh"
            )
        self.apply_state(state)
        self.start_step = self.next_step = start


class GBA(ConsistencyProtocol):
    """GBA's token-controlled training (GBA §4.1; NOTE [gba tokens]).

    Args:
        executor: the worker's :class:`PlanExecutor` (its cache holds one micro-batch's rows).
        gba_buffer: M, the contributions per global step (the job's ``--gba-buffer``).
        gba_threshold: iota of eq. (1).
    """

    name = GbaSettings.name

    @classmethod
    def for_settings(cls, executor: PlanExecutor, settings: GbaSettings) -> GBA:
        return cls(executor, gba_buffer=settings.buffer, gba_threshold=settings.threshold)

    def __init__(self, executor: PlanExecutor, gba_buffer: int, gba_threshold: int = 0):
        super().__init__(executor)
        self.m, self.iota = int(gba_buffer), int(gba_threshold)
        self.dense: GbaDense | None = None
        self._divisor = torch.tensor(float(self.m), dtype=torch.float32, device=executor.device)

    @property
    def start_step(self) -> int:
        """The job's first global step, sent as ``base`` with every GBA request (NOTE [gba checkpoints])."""
        return self.dense.start_step if self.dense is not None else 0

    def make_dense(self, model: nn.Module, optimizer: torch.optim.Optimizer, **_: object) -> GbaDense:
        """The dense side of the protocol (called by ``ScheduledLoader.attach``): no all-reduce,
        so the all-reduce settings are not read; the PS aggregates the dense gradients."""
        self.dense = GbaDense(model, optimizer)
        return self.dense

    # ------------------------------------------------------ before forward
    def before_forward(self, mb: MicroBatch) -> None:
        ex = self.executor
        keys = micro_batch_keys(mb)
        if len(keys) > ex.cache.capacity_rows:
            raise ConfigError(
                f"gba: micro-batch {mb.step} uses {len(keys)} rows, more than the worker cache's "
                f"{ex.cache.capacity_rows}; raise --cache-rows (or --cache-ratio)"
            )
        with ex.timer("pull"):
            rows, dense = self._gated_pull(mb.step // self.m, keys)
            ex.cache.clear()
            if len(keys):
                ex.cache.put(keys, rows)
        if dense is not None and self.dense is not None:
            with ex.timer("dense_allreduce"):  # the dense update, replayed from the PS's log
                self.dense.replay(*dense)
        self.count_reads(mb, np.zeros(0, np.uint64))

    def _gated_pull(self, token: int, keys: KeySet) -> tuple[np.ndarray, tuple | None]:
        """Rows of ``keys`` (float32 [n, row_width]) once every shard's global step is at
        least ``token - iota``, and shard 0's ``(first, dense grads, kept)`` (None before
        :meth:`make_dense`).

        Raises:
            PeerTimeout: a shard stayed behind for the PS timeout (names it and the steps).
        """
        ps, ex = self.executor.ps, self.executor
        by_shard = route(keys, ps.num_shards)
        since = self.dense.next_step if self.dense is not None else -1
        rows = np.empty((len(keys), ex.cache.row_width), np.float32)
        waiting, dense, pause, behind = set(range(ps.num_shards)), None, 0.0002, None
        deadline = time.monotonic() + ex.ps.timeout_ms / 1000.0
        while True:
            handles = {
                s: ps.request_async(
                    s,
                    "gba_pull",
                    {
                        "token": token,
                        "m": self.m,
                        "iota": self.iota,
                        "base": self.start_step,
                        "since": since if s == 0 else -1,
                        "parts": [{"table": t} for t, _, _ in by_shard[s]],
                    },
                    [ids for _, ids, _ in by_shard[s]],
                )
                for s in sorted(waiting)
            }
            for s, handle in handles.items():
                header, arrays = handle.wait()
                if not header.get("ready"):
                    behind = header.get("global_step")
                    continue
                waiting.discard(s)
                for (_, _, at), got in zip(by_shard[s], arrays):
                    rows[at] = got
                if s == 0 and since >= 0:
                    dense = (since, *arrays[len(by_shard[s]) : len(by_shard[s]) + 2])
            if not waiting:
                return rows, dense
            if time.monotonic() > deadline:
                raise PeerTimeout(
                    f"gba: PS shards {sorted(waiting)} stayed at global step {behind}, below token "
                    f"{token} - iota {self.iota}, for {ex.ps.timeout_ms} ms: a worker holding an "
                    "earlier micro-batch is stuck or dead (its log names the cause)",
                    peer=str(sorted(waiting)),
                    op="gba_pull",
                )
            time.sleep(pause)
            pause = min(2 * pause, MAX_RETRY_S)

    # ------------------------------------------------------ after backward
    def after_backward(self, mb: MicroBatch, step_rows: StepRows) -> None:
        ex = self.executor
        token, slot = divmod(mb.step, self.m)
        with ex.timer("grad_push"):
            grad = step_rows.rows.grad
            grads = (
                np.zeros((step_rows.rows.shape[0], ex.dim), np.float32)
                if grad is None
                else (grad.detach() / self._divisor).to("cpu", torch.float32).numpy()
            )
            keys = KeySet(step_rows.tables(), step_rows.uniq)
            dense = self.dense.flat_grad(self._divisor) if self.dense is not None else None
            handles = []
            for s, parts in enumerate(route(keys, ex.ps.num_shards)):
                arrays = [a for _, ids, at in parts for a in (ids, np.ascontiguousarray(grads[at]))]
                with_dense = s == 0 and dense is not None
                handles.append(
                    ex.ps.request_async(
                        s,
                        "gba_push",
                        {
                            "token": token,
                            "slot": slot,
                            "rank": ex.rank,
                            "m": self.m,
                            "iota": self.iota,
                            "base": self.start_step,
                            "dense": with_dense,
                            "parts": [{"table": t} for t, _, _ in parts],
                        },
                        arrays + ([dense] if with_dense else []),
                    )
                )
        with ex.timer("push_wait"):
            replies = [h.wait()[0] for h in handles]
        first = replies[0]
        self.stats["contributions"] += 1
        self.stats["gap_sum"] += max(0, int(first["staleness"]))
        self.stats["gap_max"] = max(self.stats["gap_max"], int(first["staleness"]))
        self.stats["dropped"] += int(first["dropped"])

    def flush(self, keys: KeySet, reset: bool) -> None:
        """End of the job (NOTE [gba tokens]): bring the dense replica to the PS's last global step."""
        if self.dense is not None:
            _, dense = self._gated_pull(0, KeySet.empty())
            if dense is not None:
                self.dense.replay(*dense)
        self.executor.cache.clear()


def micro_batch_keys(mb: MicroBatch) -> KeySet:
    """Every (table, id) ``mb`` reads, table by table, ids sorted (the order of :class:`StepRows`)."""
    sizes = [u.shape[0] for u in mb.unique_ids]
    table = np.repeat(np.arange(mb.num_tables, dtype=np.int32), sizes)
    ids = np.concatenate(mb.unique_ids) if mb.num_tables else np.zeros(0, np.uint64)
    return KeySet(table, ids.astype(np.uint64, copy=False))


def route(keys: KeySet, num_shards: int) -> list[list[tuple[int, np.ndarray, np.ndarray]]]:
    """Per shard, ``[(table, ids uint64 [n], positions int64 [n] in keys)]`` (every shard
    listed, maybe with no part: a GBA contribution goes to every shard)."""
    out: list[list] = [[] for _ in range(num_shards)]
    for t, at in psio.table_groups(keys.table):
        ids = np.ascontiguousarray(keys.ids[at])
        owner = shard_of(t, ids, num_shards) if num_shards > 1 else np.zeros(ids.shape[0], np.int64)
        for s in range(num_shards):
            mine = np.flatnonzero(owner == s)
            if mine.size:
                out[s].append((t, ids[mine], at[mine]))
    return out
