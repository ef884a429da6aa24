"""GBA's data list and token list on the dispatcher: micro-batches handed out on demand.

NOTE [gba tokens] (herald/ps/gba.py; GBA §4.1). Under ``--consistency gba``
the dispatcher does not schedule steps: there is no lock-step, no allocation, no
communication plan and no worker cache (every micro-batch reads its rows from the PS).
It cuts each global batch ``k`` into ``M`` micro-batches of ``G / M`` samples, in
order; micro-batch ``i = k * M + slot`` of this *data list* carries ``step = i`` (the
worker derives its token ``tau = i // M`` and slot), and hands them out on demand:
each worker holds at most ``max_inflight_steps`` unacked micro-batches, and every ack
earns it the next one, so a fast worker takes more tokens and nobody waits for a peer.
The first ones go round-robin (one per worker per round), so that the workers start on
different micro-batches of the same token.

A :class:`~herald.dispatch.records.StepRecord` is made per global batch (token) once its
``M`` micro-batches are acked, in token order (its loss the mean, its predictions in slot
order, its phases the mean, its consistency counters the sum). Scheduler counts per
worker: ``miss_pull`` = ``grad_push`` = rows each micro-batch read and pushed. At the end
every worker is flushed (its dense replica catches up with the PS's last global step)
and told ``end``.

NOTE [gba checkpoints] (NOTE [checkpoint barrier] in herald/dispatch/dispatcher.py, for
GBA). Every ``checkpoint_every_steps`` global batches (and at the end) the dispatcher
stops reading at the barrier's global batch ``b``: no micro-batch of a token past ``b`` is
handed out. Once every micro-batch up to ``b`` is acked, every shard has received exactly
``M`` contributions of each token up to ``b`` (a worker acks after its pushes were
acknowledged), so each shard's buffer is empty and its global step is ``b + 1``, whatever
``iota``. The workers are flushed (each dense replica replays the PS's log up to ``b``: the
replicas are equal), rank 0 saves the dense state (``dense.pt``, the same format as
BSP's), and ``on_checkpoint`` checkpoints the PS rows + optimizer state and writes the
dispatcher's state (next step ``b + 1``, next batch, the producer's position), as for BSP.
A checkpoint is therefore mode-free: it holds the model after ``b + 1`` global batches of
``G`` samples, which is what BSP's holds too. A job resumed from it under GBA starts its
shards' buffers at global step ``b + 1`` (the workers read it from the checkpoint's
``meta.json`` and send it as ``base`` in every GBA request) and its dense replay there;
under BSP it starts as from any BSP checkpoint. The global batch is the same in both
modes (GBA keeps the synchronous one, GBA §4), so switching ``--consistency
bsp`` <-> ``gba`` at a checkpoint needs no other change (docs/consistency.md, "Switching
modes").
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from herald import wire
from herald.contracts.microbatch import MicroBatch, make_sample_ids
from herald.contracts.plan import CAUSES, CachePlan, KeySet
from herald.dispatch.microbatch import build_parts
from herald.dispatch.records import StepRecord
from herald.errors import ConfigError, ProtocolError
from herald.loader.batch import SampleBatch

_MISS, _GRAD = CAUSES.index("miss_pull"), CAUSES.index("grad_push")


def split_global_batch(batch: SampleBatch, token: int, m: int, sample_ids: np.ndarray) -> list[MicroBatch]:
    """The ``m`` micro-batches of global batch ``token`` (contiguous slices of ``G / m``
    samples; ``step = token * m + slot``, ``rank`` = slot, an empty plan).

    Args:
        batch: the global batch, G samples; sample_ids: uint64 [G].

    Raises:
        ConfigError: G is not a multiple of m.
    """
    gb = len(batch)
    if gb % m:
        raise ConfigError(
            f"--gba-buffer {m} does not divide the global batch of {gb} samples "
            "(--workers x --batch-size); choose M dividing it"
        )
    size = gb // m
    order = np.arange(gb, dtype=np.int64)
    wstart = np.arange(0, gb + 1, size, dtype=np.int64)
    parts = build_parts(batch, order, wstart)
    out = []
    for slot in range(m):
        lo, hi = slot * size, (slot + 1) * size
        out.append(
            MicroBatch(
                token * m + slot,
                slot,
                sample_ids[lo:hi],
                batch.labels[lo:hi],
                batch.dense[lo:hi],
                *parts[slot],
                CachePlan.empty(),
                KeySet.empty(),
            )
        )
    return out


class GbaServe:
    """The serve loop of a :class:`~herald.dispatch.dispatcher.Dispatcher` under GBA (NOTE above).

    It uses the dispatcher's parts: its peer channel (``disp.channel``: send, the shape of
    an ack), step ledger (``disp.ledger``: the next step, acks received, records, ``end``)
    and barriers (``disp.barriers``: the batches and their position, flush, checkpoint).

    Args:
        disp: the dispatcher, after its handshake.
    """

    def __init__(self, disp: Any):
        self.disp = disp
        self.channel, self.ledger, self.barriers = disp.channel, disp.ledger, disp.barriers
        self.m = int(disp.job.mode.buffer or disp.config.num_workers)
        self.workers = disp.config.num_workers
        self.credit = disp.config.max_inflight_steps
        self._batches = iter(self.barriers.batches)
        self._ids_of = getattr(self.barriers.batches, "sample_ids", None)
        self._queue: collections.deque = collections.deque()  # (i, frames, rows of the micro-batch)
        self._held: dict[int, dict[int, int]] = {r: {} for r in range(self.workers)}  # rank -> {i: rows}
        self._acks: dict[int, dict[int, tuple]] = {}  # token -> {slot: (rank, header, arrays, rows)}
        self._ids: dict[int, np.ndarray] = {}  # token -> sample ids (for the id log)
        self._next_token = self.ledger.next_step
        self._next_record = self.ledger.next_step
        self._exhausted = False
        self.every = int(disp.config.checkpoint_every_steps or 0)
        self._barrier_due: int | None = None  # NOTE [gba checkpoints]: batch index of the barrier reached
        self._last_index = self.barriers.next_batch - 1  # index of the last global batch read

    # ------------------------------------------------------------ data list
    def _fill(self) -> bool:
        """Queue the next global batch's micro-batches; False when there is none, or when a
        checkpoint barrier was reached (nothing past it is read: NOTE [gba checkpoints])."""
        if self._barrier_due is not None:
            return False
        if self._exhausted or self.disp.stopping:
            self._exhausted = True
            return False
        with self.disp.timer("read"):
            batch = next(self._batches, None)
        if batch is None:
            self._exhausted = True
            return False
        token = self._next_token
        self._next_token += 1
        self._last_index = index = self.barriers.next_batch
        self.barriers.batch_read(index)
        if self.every and (index + 1) % self.every == 0:
            self._barrier_due = index
        ids = self._ids_of(token) if self._ids_of is not None else None
        if ids is None:
            ids = make_sample_ids(self.disp.config.dispatcher_rank, token * len(batch), len(batch))
        self._ids[token] = ids
        with self.disp.timer("build"):
            for mb in split_global_batch(batch, token, self.m, ids):
                rows = int(sum(u.shape[0] for u in mb.unique_ids))
                self._queue.append((mb.step, wire.pack(*mb.to_frames()), rows))
        if self.channel.peers.ack_rows is None:
            self.channel.peers.ack_rows = len(batch) // self.m
        return True

    def _hand_out(self) -> None:
        """Give every worker below its credit the next micro-batches, one per worker per round."""
        progress = True
        while progress:
            progress = False
            for rank in range(self.workers):
                if len(self._held[rank]) >= self.credit or (not self._queue and not self._fill()):
                    continue
                i, frames, rows = self._queue.popleft()
                with self.disp.timer("send"):
                    self.channel.route(rank, frames)
                self._held[rank][i] = rows
                progress = True

    # ---------------------------------------------------------------- serve
    def run(self) -> list:
        disp = self.disp
        while True:
            self._hand_out()
            held = {r: sorted(h) for r, h in self._held.items() if h}
            if not held and not self._queue:
                if self._barrier_due is None or disp.stopping:
                    break
                self._barrier(self._barrier_due)  # every micro-batch up to the barrier acked
                self._barrier_due = None
                continue
            with disp.timer("wait_credit"):
                msg = self.ledger.receive_ack(
                    f"an ack of micro-batches {held} (rank: data-list indices)", ranks=sorted(held)
                )
            self._record_ack(msg.rank, msg.header, msg.arrays)
        self._barrier(self._last_index)  # the final one (NOTE [gba checkpoints])
        return self.ledger.end()

    def _barrier(self, index: int) -> None:
        """NOTE [gba checkpoints]: every micro-batch up to global batch ``index`` is acked;
        flush the workers (dense replicas at the PS's global step), then checkpoint when
        the job does (once per step, and only for a step this process trained)."""
        if self._acks or any(self._held.values()) or self._queue:
            raise ProtocolError(
                f"gba checkpoint barrier at global batch {index} with micro-batches still in flight; "
                "this is a bug (NOTE [gba checkpoints])"
            )
        # the dense replicas catch up with the last global step
        self.barriers.flush([[np.zeros(0, np.int32), np.zeros(0, np.uint64)] for _ in range(self.workers)], reset=False)
        self.ledger.next_step = self._next_record
        self.barriers.complete(self._next_record - 1, index)

    def _record_ack(self, rank: int, header: dict[str, Any], arrays: list) -> None:
        i = header["step"]
        if i not in self._held[rank]:
            raise ProtocolError(
                f"unexpected ack of micro-batch {i!r} from rank {rank} (it holds {sorted(self._held[rank])})"
            )
        rows = self._held[rank].pop(i)
        token, slot = divmod(i, self.m)
        self._acks.setdefault(token, {})[slot] = (rank, header, arrays, rows)
        while len(self._acks.get(self._next_record, ())) == self.m:  # records in token order
            self._emit(self._next_record, self._acks.pop(self._next_record))
            self._next_record += 1

    def _emit(self, token: int, by_slot: dict[int, tuple]) -> None:
        acks = [by_slot[s][1:3] for s in range(self.m)]
        counts = np.zeros((self.workers, len(CAUSES)), np.int64)
        for rank, _, _, rows in by_slot.values():
            counts[rank, _MISS] += rows
            counts[rank, _GRAD] += rows
        self.ledger.emit(token, acks, counts, 0.0, self._ids.pop(token))


def serve_gba(disp: Any) -> list[StepRecord]:
    """GBA's serve strategy (its entry in :data:`herald.dispatch.modes.DISPATCH`): the data list and
    token list of :class:`GbaServe` (NOTE above) over the dispatcher ``disp``."""
    return GbaServe(disp).run()
