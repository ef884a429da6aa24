"""GBA's data list and token list on the dispatcher: micro-batches handed out on demand.

NOTE [gba tokens] (herald/ps/gba.py; gba-neurips22 §4.1). Under ``--consistency gba``
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
and told ``end``. Checkpoint barriers are not supported under GBA yet (the settings check
refuses ``--checkpoint-every`` and ``--resume``).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from herald import wire
from herald.dispatch.microbatch import MicroBatch, build_parts, make_sample_ids
from herald.dispatch.records import StepRecord, mean_phases, sum_consistency
from herald.errors import ConfigError, ProtocolError
from herald.loader.batch import SampleBatch
from herald.scheduler.plan import CAUSES, CachePlan, KeySet

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
        raise ConfigError(f"--gba-buffer {m} does not divide the global batch of {gb} samples "
                          "(--workers x --batch-size); choose M dividing it")
    size = gb // m
    order = np.arange(gb, dtype=np.int64)
    wstart = np.arange(0, gb + 1, size, dtype=np.int64)
    parts = build_parts(batch, order, wstart)
    out = []
    for slot in range(m):
        lo, hi = slot * size, (slot + 1) * size
        out.append(MicroBatch(token * m + slot, slot, sample_ids[lo:hi], batch.labels[lo:hi], batch.dense[lo:hi],
                              *parts[slot], CachePlan.empty(), KeySet.empty()))
    return out


class GbaServe:
    """The serve loop of a :class:`~herald.dispatch.dispatcher.Dispatcher` under GBA (NOTE above).

    Args:
        disp: the dispatcher, after its handshake (its socket, peers, batches, callbacks).
    """

    def __init__(self, disp: Any):
        if disp._on_checkpoint is not None:
            raise ConfigError("--consistency gba has no checkpoint barriers yet, and this job checkpoints (a stream "
                              "source, --checkpoint-every or a checkpoint folder): train a file source without "
                              "checkpoints, or choose another --consistency")
        self.disp = disp
        self.m = int(disp._job.gba_buffer or disp.config.num_workers)
        self.workers = disp.config.num_workers
        self.credit = disp.config.max_inflight_steps
        self._batches = iter(disp._batches)
        self._ids_of = getattr(disp._batches, "sample_ids", None)
        self._queue: collections.deque = collections.deque()   # (i, frames, rows of the micro-batch)
        self._held: dict[int, dict[int, int]] = {r: {} for r in range(self.workers)}   # rank -> {i: rows}
        self._acks: dict[int, dict[int, tuple]] = {}   # token -> {slot: (rank, header, arrays, rows)}
        self._ids: dict[int, np.ndarray] = {}          # token -> sample ids (for the id log)
        self._next_token = disp.next_step
        self._next_record = disp.next_step
        self._exhausted = False

    # ------------------------------------------------------------ data list
    def _fill(self) -> bool:
        """Queue the next global batch's micro-batches; False when there is none."""
        if self._exhausted or self.disp._stop.is_set():
            self._exhausted = True
            return False
        with self.disp.timer("read"):
            batch = next(self._batches, None)
        if batch is None:
            self._exhausted = True
            return False
        token = self._next_token
        self._next_token += 1
        self.disp._next_batch += 1
        ids = self._ids_of(token) if self._ids_of is not None else None
        if ids is None:
            ids = make_sample_ids(self.disp.config.dispatcher_rank, token * len(batch), len(batch))
        self._ids[token] = ids
        with self.disp.timer("build"):
            for mb in split_global_batch(batch, token, self.m, ids):
                rows = int(sum(u.shape[0] for u in mb.unique_ids))
                self._queue.append((mb.step, wire.pack(*mb.to_frames()), rows))
        if self.disp._peers.ack_rows is None:
            self.disp._peers.ack_rows = len(batch) // self.m
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
                    self.disp._route(rank, frames)
                self._held[rank][i] = rows
                progress = True

    # ---------------------------------------------------------------- serve
    def run(self) -> list:
        disp = self.disp
        while True:
            self._hand_out()
            held = {r: sorted(h) for r, h in self._held.items() if h}
            if not held:
                break
            deadline = time.monotonic() + disp.config.peer_timeout_ms / 1e3
            with disp.timer("wait_credit"):
                msg = disp._recv(deadline, waiting_for=f"an ack of micro-batches {held} (rank: data-list indices)")
            if msg.header["op"] != "ack":
                raise ProtocolError(f"expected ack, got {msg.header['op']!r} from worker {msg.rank}")
            self._record_ack(msg.rank, msg.header, msg.arrays)
        for rank in range(self.workers):   # the dense replicas catch up with the last global step
            disp._send(rank, {"op": "flush", "reset": False}, [np.zeros(0, np.int32), np.zeros(0, np.uint64)])
        disp._expect(set(range(self.workers)), "flushed")
        disp.next_step = self._next_record
        disp._at_barrier = True
        for rank in range(self.workers):
            disp._send(rank, {"op": "end", "steps": disp.next_step})
        if disp.records:
            disp.records[-1].rejected = disp.rejected
        return disp.records

    def _record_ack(self, rank: int, header: dict[str, Any], arrays: list) -> None:
        i = header["step"]
        if i not in self._held[rank]:
            raise ProtocolError(f"unexpected ack of micro-batch {i!r} from rank {rank} (it holds "
                                f"{sorted(self._held[rank])})")
        rows = self._held[rank].pop(i)
        token, slot = divmod(i, self.m)
        self._acks.setdefault(token, {})[slot] = (rank, header, arrays, rows)
        while len(self._acks.get(self._next_record, ())) == self.m:   # records in token order
            self._emit(self._next_record, self._acks.pop(self._next_record))
            self._next_record += 1

    def _emit(self, token: int, by_slot: dict[int, tuple]) -> None:
        disp = self.disp
        acks = [by_slot[s][1:3] for s in range(self.m)]
        counts = np.zeros((self.workers, len(CAUSES)), np.int64)
        for rank, _, _, rows in by_slot.values():
            counts[rank, _MISS] += rows
            counts[rank, _GRAD] += rows
        preds = [a for _, a in acks if len(a) == 2]
        rec = StepRecord(token, float(np.mean([h.get("loss", float("nan")) for h, _ in acks])), counts,
                         sum(int(h.get("bytes_pulled", 0)) for h, _ in acks),
                         sum(int(h.get("bytes_pushed", 0)) for h, _ in acks), 0.0,
                         np.concatenate([a[0] for a in preds]) if preds else np.zeros(0, np.float32),
                         np.concatenate([a[1] for a in preds]) if preds else np.zeros(0, np.float32),
                         0, mean_phases(acks), time.perf_counter(), disp.rejected, sum_consistency(acks))
        disp.records.append(rec)
        ids = self._ids.pop(token)
        if disp._id_log is not None:
            disp._id_log.write(np.ascontiguousarray(ids, np.uint64).tobytes())
            disp._id_log.flush()
        if disp._on_step is not None:
            disp._on_step(rec)
