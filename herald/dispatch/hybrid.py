"""Persia's embedding worker inside the dispatcher: gradients by sample id, pushed asynchronously.

NOTE [hybrid training]
~~~~~~~~~~~~~~~~~~~~~~
Persia trains the dense part synchronously and the embeddings asynchronously (Persia §3,
Alg. 1; §4.2 the embedding worker). In herald (``--consistency hybrid``):

1. **Hand-out.** The dispatcher keeps every micro-batch it sends in its ID-feature buffer,
   keyed by sample id (:class:`~herald.dispatch.idbuffer.IdFeatureBuffer`, Persia §4.2.1),
   until every worker acked its step. It sends step ``t`` only within the credit window
   (``max_inflight_steps`` W, NOTE [dispatch protocol]) and only once the embedding
   updates of steps ``<= t - W`` are applied on the PS (:meth:`HybridEmbeddingWorker.
   before_send`): the staleness of a read is therefore at most ``W - 1`` steps.
2. **Reads.** A worker (``herald/worker/consistency_hybrid.py``) holds no embedding rows:
   it pulls every row its micro-batch reads from the PS as soon as the micro-batch arrives
   (while the step before still computes), without waiting for earlier steps' updates, and
   writes nothing into its cache; there is no communication plan.
3. **Gradients by sample id.** After backward the worker sends, with its ack, the sample
   ids (uint64 [b]) and the gradient of each sample's pooled embedding bag per table
   (float32 [b, T, dim], divided by the number of workers like every herald gradient), and
   goes on: it never waits for them to be applied. The dense all-reduce stays synchronous.
4. **Expansion and push.** The dispatcher resolves the sample ids in its buffer
   (:meth:`IdFeatureBuffer.resolve`) to the ID features of each sample; with sum pooling
   each id of a bag receives the bag's gradient (:func:`expand_gradients`), summed per
   (table, id) in float64 (:func:`sum_per_key`): these two, table by table, are the
   definition, and the reference the tests hold the fast path to. The dispatcher computes
   the same as each ack arrives, every table at once from the micro-batch's flat arrays,
   into the step's key list made at its first ack (:func:`step_union`,
   :func:`rank_key_sums`); once a step's acks are all in, the ranks' sums are added per
   key in rank order (:func:`merge_ranks`)
   and pushed to the PS shards as one contribution per key
   (``contributors`` 1: the shard applies the sparse optimizer once per key and step, NOTE
   [ps aggregation]) by a background thread with its own PS client
   (:class:`GradientPusher`): the serve thread never waits on it except in 1. and at a
   checkpoint barrier (every update applied before the PS is checkpointed). A shard that
   stops answering is reported by name (the client's PeerTimeout), re-raised in the serve
   thread. This work is on the hand-out's critical path (the push of step ``t - W`` gates
   step ``t``), so it is vectorized: per table and rank it cost ~3 ms of the serve thread
   per step on the Criteo sample (26 tables), all tables at once ~1 ms (docs/consistency.md,
   "What is on hybrid's critical path").
5. **Expiry.** A gradient arriving more than ``hybrid_expiry_steps`` steps after its step
   was handed out (the dispatcher's newest step minus the sample's) is dropped with its
   samples, counted (``dropped``). Within the credit window the age is at most ``W - 1``,
   so only an expiry below that drops anything (a straggler's late acks).
6. **Staleness** of step ``t`` = the steps before ``t`` whose embedding updates were not
   yet applied on the PS when ``t`` was handed out: an upper bound on the updates missing
   from any row the step reads (the worker pulls after the hand-out). Reported per step.

With ``W = 1`` (``--max-inflight-steps 1``) step ``t`` is handed out after every ack of
``t - 1`` and after its update was applied, so every read is latest and each key gets one
optimizer application per step with the full gradient sum: hybrid then equals BSP and the
single-process reference within float rounding of the summation order
(tests/integration/test_hybrid.py).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from herald.contracts.microbatch import MicroBatch
from herald.dispatch.idbuffer import IdFeatureBuffer
from herald.errors import HeraldError, PeerTimeout, ProtocolError
from herald.ps import PSClient

#: steps whose gradients may wait for the push thread (beyond it the serve thread waits, bounded)
PUSH_QUEUE_STEPS = 64


def expand_gradients(ids: np.ndarray, lengths: np.ndarray, bag_grads: np.ndarray) -> np.ndarray:
    """Each id's gradient under sum pooling: its bag's (Persia §4.2: gradients by sample id).

    Args:
        ids: uint64 [nnz], the samples' ids of one table, sample after sample.
        lengths: int64 [n], ids per sample (sum = nnz).
        bag_grads: float [n, dim], the gradient of each sample's pooled bag.

    Returns:
        float [nnz, dim]: row j is the gradient of ``ids[j]``'s bag.

    Raises:
        ProtocolError: ``lengths`` does not add up to ``ids`` or ``bag_grads`` has not one row per sample.
    """
    if int(lengths.sum()) != ids.shape[0] or bag_grads.shape[0] != lengths.shape[0]:
        raise ProtocolError(
            f"{lengths.shape[0]} samples with {int(lengths.sum())} ids, {ids.shape[0]} ids and "
            f"{bag_grads.shape[0]} bag gradients: one gradient per sample, one length per sample"
        )
    return np.repeat(bag_grads, lengths, axis=0)


def sum_per_key(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum ``grads`` (float [m, dim]) per id (uint64 [m]), in float64, in the order given.

    Returns:
        ``(keys uint64 [u] sorted unique, sums float64 [u, dim])``.
    """
    if not ids.shape[0]:
        return np.zeros(0, np.uint64), np.zeros((0, grads.shape[1]), np.float64)
    keys, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    starts = np.flatnonzero(np.diff(inverse[order], prepend=-1))
    return keys, np.add.reduceat(grads[order].astype(np.float64), starts, axis=0)


def step_union(mbs: list[MicroBatch]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The keys one step's micro-batches read, and where each micro-batch's keys are among them.

    Args:
        mbs: the step's micro-batches (NOTE [micro-batch layout]: each one's distinct ids
            ``ids_flat``, sorted per table).

    Returns:
        ``(table int64 [u], ids uint64 [u], rows)``: every (table, id) of the step once,
        sorted by (table, id); ``rows[i]`` (int64 [len(mbs[i].ids_flat)]) gives the row of
        each of ``mbs[i]``'s distinct ids in that list.
    """
    tables = [np.repeat(np.arange(mb.num_tables, dtype=np.int64), np.diff(mb.id_bounds)) for mb in mbs]
    table = np.concatenate(tables) if tables else np.zeros(0, np.int64)
    ids = np.concatenate([mb.ids_flat for mb in mbs]) if mbs else np.zeros(0, np.uint64)
    order = np.lexsort((ids, table.astype(np.int16) if table.shape[0] and int(table.max()) < 2**15 else table))
    table, ids = table[order], ids[order]
    first = np.ones(table.shape[0], bool)
    first[1:] = (table[1:] != table[:-1]) | (ids[1:] != ids[:-1])
    rows = np.empty(table.shape[0], np.int64)
    rows[order] = np.cumsum(first) - 1
    return table[first], ids[first], np.split(rows, np.cumsum([t.shape[0] for t in tables])[:-1])


def rank_key_sums(
    mb: MicroBatch, index: np.ndarray, bag_grads: np.ndarray, rows: np.ndarray, n_keys: int
) -> tuple[np.ndarray, np.ndarray]:
    """One rank's gradient per key of its step: :func:`expand_gradients` then
    :func:`sum_per_key` for every table at once, from the micro-batch's flat arrays (NOTE
    [micro-batch layout]: its inverse index gives each value's row among its distinct ids),
    into the step's key list (:func:`step_union`).

    Args:
        mb: the rank's buffered micro-batch (``b`` samples, ``T`` tables).
        index: int64 [n], the micro-batch row of each gradient (distinct; :meth:`IdFeatureBuffer.resolve`).
        bag_grads: float [n, T, dim], the gradient of each of those samples' pooled bags.
        rows, n_keys: ``mb``'s ``rows`` and the length of the step's key list (:func:`step_union`).

    Returns:
        ``(sums float64 [n_keys, dim], used bool [n_keys])``: per key of the step, the sum
        of the gradients of its values in the samples of ``index`` (0 and not used if none),
        added in float64 in the micro-batch's order (the ack's order when, as a worker sends
        it, the ack lists the samples as the micro-batch does: then exactly :func:`sum_per_key`'s).
    """
    dim = bag_grads.shape[2]
    if not mb.num_tables:
        return np.zeros((n_keys, dim), np.float64), np.zeros(n_keys, bool)
    offsets = mb.offsets_flat
    n_tables, b = offsets.shape[0], offsets.shape[1] - 1
    lengths = np.diff(offsets, axis=1).ravel()  # [T * b]: table-major, as inverse_flat
    sample = np.repeat(np.tile(np.arange(b, dtype=np.int64), n_tables), lengths)
    table = np.repeat(np.arange(n_tables, dtype=np.int64), offsets[:, -1])
    key = rows[mb.id_bounds[:-1][table] + mb.inverse_flat.astype(np.int64)]  # row in the step's keys
    if index.shape[0] != b or (index != np.arange(b)).any():
        at = np.full(b, -1, np.int64)
        at[index] = np.arange(index.shape[0])
        row = at[sample]
        keep = row >= 0
        sample, table, key = row[keep], table[keep], key[keep]
    occurrences = np.ascontiguousarray(bag_grads[sample, table].T)  # [dim, nnz]
    sums = np.empty((n_keys, dim), np.float64)
    for d in range(dim):  # bincount adds in input order, in float64 (np.add.at: 15x slower)
        sums[:, d] = np.bincount(key, weights=occurrences[d], minlength=n_keys)
    return sums, np.bincount(key, minlength=n_keys) > 0


def merge_ranks(
    table: np.ndarray, ids: np.ndarray, per_rank: list[tuple[np.ndarray, np.ndarray]], num_tables: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Add the ranks' :func:`rank_key_sums` in the order given (rank order), in float64, into
    ``{table: (keys uint64 [u] sorted unique, grads float32 [u, dim])}`` of the keys some
    rank used (tables without one left out): what :class:`GradientPusher` pushes.
    ``table``, ``ids``: the step's key list (:func:`step_union`)."""
    if not per_rank:
        return {}
    total, used = per_rank[0][0].copy(), per_rank[0][1].copy()
    for sums, u in per_rank[1:]:
        total += sums
        used |= u
    table, ids, total = table[used], ids[used], total[used]
    bounds = np.searchsorted(table, np.arange(num_tables + 1)).tolist()
    return {
        t: (ids[bounds[t] : bounds[t + 1]], total[bounds[t] : bounds[t + 1]].astype(np.float32))
        for t in range(num_tables)
        if bounds[t + 1] > bounds[t]
    }


class GradientPusher:
    """A background thread that pushes each step's summed gradients to the PS, in step order.

    Args:
        client_factory: returns a :class:`~herald.ps.PSClient` (created and used on the thread:
            a client is not thread-safe).
        first_step: the first step of this dispatcher (steps before it count as applied).
        timeout_s: longest wait in :meth:`wait_applied` and :meth:`submit` beyond the client's own.

    Attributes:
        applied_through: the last step whose push the shards acknowledged.
        submitted_through: the last step queued.
        rows_pushed: (table, id) gradients pushed so far.
    """

    def __init__(self, client_factory, first_step: int, timeout_s: float):
        self._factory, self._timeout_s = client_factory, timeout_s
        self.applied_through = first_step - 1
        self.submitted_through = first_step - 1
        self.rows_pushed = 0
        self._queue: queue.Queue = queue.Queue(PUSH_QUEUE_STEPS)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybrid-push", daemon=True)
        self._thread.start()

    def submit(self, step: int, parts: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Queue ``{table: (keys uint64 [u] unique, grads float32 [u, dim])}`` of ``step``.

        Raises:
            ProtocolError: steps out of order. PeerTimeout: the queue stayed full. The push
                thread's own error, if it failed.
        """
        self._raise_error()
        if step <= self.submitted_through:
            raise ProtocolError(
                f"hybrid gradients of step {step} after step {self.submitted_through}: steps "
                "complete in order (NOTE [hybrid training]); this is a bug"
            )
        try:
            self._queue.put((step, parts), timeout=self._timeout_s)
        except queue.Full:
            self._raise_error()
            raise PeerTimeout(
                f"the dispatcher's hybrid push thread took no gradients for {self._timeout_s:.0f} s "
                f"(applied through step {self.applied_through}); check the PS shards' logs",
                peer="ps",
                op="push_grad",
            ) from None
        self.submitted_through = step

    def wait_applied(self, step: int) -> None:
        """Block until the pushes of every step ``<= step`` are acknowledged (bounded).

        Raises:
            PeerTimeout: not within ``timeout_s`` (the client names a silent shard sooner).
            The push thread's error (e.g. a PeerTimeout naming the shard).
        """
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            while self.applied_through < step and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(
                        f"the PS did not acknowledge the hybrid gradients of step {step} within "
                        f"{self._timeout_s:.0f} s (applied through step {self.applied_through}); "
                        "check the PS shards' logs",
                        peer="ps",
                        op="push_grad",
                    )
                self._cond.wait(min(left, 0.5))
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise HeraldError(
                f"hybrid gradient push failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def _run(self) -> None:
        client = None
        try:
            client = self._factory()
            while not self._closing.is_set():
                try:
                    step, parts = self._queue.get(timeout=0.2)
                except queue.Empty:
                    continue
                if parts:
                    batch = {t: (k, g, np.ones(k.shape[0], np.uint16)) for t, (k, g) in parts.items()}
                    client.push_grad_async(batch, step=step, rank=0).wait()
                with self._cond:
                    self.applied_through = step
                    self.rows_pushed += sum(k.shape[0] for k, _ in parts.values())
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the serve thread, never lost
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            if client is not None:
                client.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (joined for at most ``timeout_s``); idempotent. Queued pushes
        not yet sent are dropped: call :meth:`wait_applied` first to keep them."""
        self._closing.set()
        self._thread.join(timeout_s)


class HybridEmbeddingWorker:
    """The dispatcher's half of NOTE [hybrid training] (Persia's embedding worker, Persia §4.2).

    Args:
        num_tables, dim: the job's tables and embedding dim (the shape of the bag gradients).
        max_inflight_steps: the credit window W.
        expiry_steps: drop gradients older than this many steps (None: never).
        first_step: the dispatcher's first step.
        pusher: the :class:`GradientPusher` (owned: closed by :meth:`close`).
    """

    def __init__(
        self,
        num_tables: int,
        dim: int,
        max_inflight_steps: int,
        expiry_steps: int | None,
        first_step: int,
        pusher: GradientPusher,
    ):
        self.num_tables, self.dim = num_tables, dim
        self.window, self.expiry = max_inflight_steps, expiry_steps
        self.pusher = pusher
        self._staleness: dict[int, int] = {}
        # step -> rank -> its gradient per key of the step (rank_key_sums): (sums, used)
        self._grads: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._keys: dict[int, tuple] = {}  # step -> its keys (step_union): (table, ids, {rank: rows})
        self._dropped: dict[int, int] = {}

    def before_send(self, step: int) -> None:
        """Wait (bounded) until the updates of steps ``<= step - W`` are applied; record the
        staleness of ``step`` (NOTE [hybrid training] 1 and 6)."""
        self.pusher.wait_applied(step - self.window)
        self._staleness[step] = max(0, step - 1 - self.pusher.applied_through)

    def receive(
        self, step: int, rank: int, arrays: list[np.ndarray], buffer: IdFeatureBuffer, newest_step: int
    ) -> list[np.ndarray]:
        """Take the gradients by sample id off an ack of ``step`` from ``rank`` (its last two
        arrays: sample ids uint64 [b], bag gradients float32 [b, T, dim]); returns the other
        arrays (labels and predictions, or none).

        Raises:
            ProtocolError: the ack carries no gradients, sample ids not of that rank's
                micro-batch at that step, or one sample id twice.
        """
        if len(arrays) < 2 or arrays[-2].dtype != np.uint64 or arrays[-1].ndim != 3:
            raise ProtocolError(
                f"a hybrid ack of step {step} from worker {rank} carries no gradients by sample id "
                "(NOTE [hybrid training]): run every worker with the same herald version"
            )
        ids, grads = arrays[-2], arrays[-1]
        found = buffer.resolve(ids, step)
        if ids.shape[0] and not ((found.step == step).all() and (found.rank == rank).all()):
            bad = int(np.flatnonzero((found.step != step) | (found.rank != rank))[0])
            raise ProtocolError(
                f"worker {rank} sent a gradient for sample id {int(ids[bad])} of step {step}, which "
                f"is not in its micro-batch (at that step the buffer has it at rank "
                f"{int(found.rank[bad])}; -1: nowhere)"
            )
        if np.unique(found.index).shape[0] != found.index.shape[0]:
            raise ProtocolError(f"worker {rank} sent two gradients for one sample of step {step}: one per sample")
        if self.expiry is not None and newest_step - step > self.expiry:  # NOTE [hybrid training] 5
            self._dropped[step] = self._dropped.get(step, 0) + int(ids.shape[0])
        else:
            # summed per key now, while the other ranks' acks are still coming (off the hand-out's path)
            if step not in self._keys:
                mbs = buffer.micro_batches(step)
                table, keys, rows = step_union(mbs)
                self._keys[step] = (table, keys, {mb.rank: r for mb, r in zip(mbs, rows)})
            table, keys, rows = self._keys[step]
            self._grads.setdefault(step, {})[rank] = rank_key_sums(
                buffer.micro_batch(step, rank), found.index, grads, rows[rank], keys.shape[0]
            )
        return arrays[:-2]

    def step_acked(self, step: int, buffer: IdFeatureBuffer) -> dict[str, int]:
        """Every worker acked ``step``: expand, sum and queue its push (call before the buffer
        releases it). Returns the step's counters for the report: ``staleness`` (steps),
        ``dropped`` (samples expired), ``hybrid_rows`` ((table, id) gradients pushed)."""
        by_rank = self._grads.pop(step, {})
        table, keys, _ = self._keys.pop(step, (None, None, None))
        parts = merge_ranks(table, keys, [by_rank[rank] for rank in sorted(by_rank)], self.num_tables)
        self.pusher.submit(step, parts)
        return {
            "staleness": self._staleness.pop(step, 0),
            "dropped": self._dropped.pop(step, 0),
            "hybrid_rows": sum(k.shape[0] for k, _ in parts.values()),
        }

    def drain(self) -> None:
        """Wait (bounded) until every queued push is applied: at a checkpoint barrier."""
        self.pusher.wait_applied(self.pusher.submitted_through)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the push thread (:meth:`GradientPusher.close`), bounded by ``timeout_s``."""
        self.pusher.close(timeout_s)


def make_hybrid(job: Any, config: Any, first_step: int, peers: Any) -> HybridEmbeddingWorker:
    """The :class:`HybridEmbeddingWorker` of ``job`` (a :class:`~herald.contracts.job.JobSpec` of a
    mode whose entry in :data:`herald.dispatch.modes.DISPATCH` names this factory as its
    ``embedding_worker``: hybrid), with a PS client of its shards on its push thread.
    ``config``: the :class:`~herald.dispatch.config.DispatcherConfig`; ``peers``: the
    dispatcher's :class:`~herald.dispatch.peers.PeerTable` (its acks then carry gradients)."""
    peers.ack_grads = (len(job.tables), job.dim)
    max_inflight_steps, timeout_ms = config.max_inflight_steps, config.peer_timeout_ms

    def client():
        return PSClient(
            list(job.ps),
            tables=list(job.tables),
            timeout_ms=job.timeout_ms,
            keys_dir=job.keys_dir,
            wire_dtype=job.comm.wire_dtype,
        )

    pusher = GradientPusher(client, first_step, timeout_s=2 * max(job.timeout_ms, timeout_ms) / 1e3 + 1.0)
    return HybridEmbeddingWorker(
        len(job.tables), job.dim, max_inflight_steps, job.mode.expiry_steps, first_step, pusher
    )
