"""Micro-batches: one worker's share of a global batch, with its cache plan.

The layout and its wire codec, a contract between the dispatcher and the workers
(docs/design.md, "Layers"): built by the dispatcher from the scheduler's allocation
(:func:`herald.dispatch.microbatch.build_microbatch`), sent over ZeroMQ with
:mod:`herald.wire`, rebuilt by the worker (:meth:`MicroBatch.from_frames`). Imports
numpy only (no numba, torch or zmq). Per table the micro-batch carries the
*unique* ids and an inverse index (Persia §4.2.3's lossless compression), so the
worker gathers each embedding once. All tables travel in a few flat arrays.

NOTE [micro-batch layout] (``T`` tables, ``b`` samples). A ``microbatch`` message
(:mod:`herald.wire` framing) carries ONE array frame, ``blob`` (uint8), holding 13
parts back to back, each starting at the next multiple of 8 bytes (the first at 0,
the blob ending where the last part ends). The header is ``{op: "microbatch", step,
rank, tables: T, layout: 2, parts: [[dtype, shape], ...]}`` with one descriptor per
part, in this order (a few large frames: one ZeroMQ send per micro-batch instead of
one per array, which is most of what sending costs)::

    sample_ids    uint64 [b]
    labels        float32 [b]
    dense         float32 [b, D]
    ids_flat      uint64 [U]       table t's sorted distinct ids are
    id_bounds     int64 [T+1]        ids_flat[id_bounds[t]:id_bounds[t+1]]
    inverse_flat  uint16|int32 [N] table t's part is inverse_flat[n[t]:n[t+1]], with
                                     n = [0, cumsum(offsets_flat[:, -1])]; each entry an
                                     index into the table's own distinct ids (uint16 when
                                     every table has fewer than 65,536 values, else int32)
    offsets_flat  int64 [T, b+1]   row t: table t's offsets, as in SampleBatch
    key_table     int32 [K]        the plan's key lists and the replicated keys,
    key_ids       uint64 [K]         concatenated: list k is [key_bounds[k], key_bounds[k+1])
    key_bounds    int64 [7]          in the order evict, pull, grad_push, update_local,
                                     plan_push, replicated
    write_back    bool [len(evict)]
    contributors  uint16 [len(grad_push)]
    pull_early    bool [len(pull)]

The receiver checks the descriptors (each part's dtype is fixed but for
``inverse_flat``; shapes of at most 2 dims) and that they add up to the blob's size
before making any view, then the contents as listed in :meth:`MicroBatch.from_frames`.

Example: two samples, tables ``user`` (ids 7, 9) and ``tags`` (sample 0: 11, 12;
sample 1: 11) give ``ids_flat = [7, 9, 11, 12]``, ``id_bounds = [0, 2, 4]``,
``inverse_flat = [0, 1, 0, 1, 0]``, ``offsets_flat = [[0, 1, 2], [0, 2, 3]]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from herald.contracts.plan import CachePlan, KeySet
from herald.errors import ProtocolError

#: sample id = dispatcher rank in the top 8 bits, sequence number below (Persia §4.1).
SAMPLE_ID_RANK_SHIFT = 56
SAMPLE_ID_SEQ_MASK = (1 << SAMPLE_ID_RANK_SHIFT) - 1
#: version of NOTE [micro-batch layout] (the header's ``layout``)
LAYOUT = 2
#: The largest array frame a dispatcher sends a worker (a micro-batch's blob, a flush's
#: ids), in bytes, and so the bound of the worker's socket, set before the worker knows
#: its job (NOTE [message size limits] in herald/wire.py). The dispatcher checks every
#: frame it sends against it (:meth:`herald.dispatch.channel.PeerChannel.route`). 1 GiB:
#: a micro-batch of several hundred thousand Criteo samples with its plan.
MAX_WORKER_FRAME_BYTES = 1 << 30
_NUM_KEY_LISTS = 6  # evict, pull, grad_push, update_local, plan_push, replicated
#: NOTE [micro-batch layout]: each part's dtype(s), in blob order
_PART_DTYPES = (
    ("<u8",),
    ("<f4",),
    ("<f4",),
    ("<u8",),
    ("<i8",),
    ("<u2", "<i4"),
    ("<i8",),
    ("<i4",),
    ("<u8",),
    ("<i8",),
    ("|b1",),
    ("<u2",),
    ("|b1",),
)
_NUM_PARTS = len(_PART_DTYPES)
_DTYPES = {name: np.dtype(name) for names in _PART_DTYPES for name in names}
_MAX_DIM = 1 << 40


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
    """Worker ``rank``'s samples at ``step`` (arrays as in NOTE [micro-batch layout]).

    Attributes:
        step: global step index (0-based).
        rank: worker rank.
        sample_ids: uint64 [b].
        labels: float32 [b]; dense: float32 [b, D].
        ids_flat: uint64 [U]: every table's distinct ids (sorted within a table).
        id_bounds: int64 [T+1]: table t's are ``ids_flat[id_bounds[t]:id_bounds[t+1]]``.
        inverse_flat: uint16 or int32 [N]: per table, an index into its distinct ids
            for each of its values, table after table.
        offsets_flat: int64 [T, b+1]: row t is table t's offsets (as in
            :class:`herald.loader.batch.SampleBatch`).
        plan: the worker's :class:`CachePlan` for this step.
        replicated: the keys of replicated tables that any worker uses this step,
            sorted by (table, id) and equal on every rank: the rows all-reduced and
            updated on every replica (docs/design.md, "Replicated tables").
        pull_early: bool [len(plan.pull)]: the PS copy of this key is final before the
            previous step's pushes (NOTE [early pulls] in herald/dispatch/early.py);
            all False (wait) by default.
        next_follows: the micro-batch of step ``step + 1`` comes next on this worker's
            channel and the credit window lets it be sent before this step's ack (no
            barrier, no end in between): a worker may wait for it before ending this step,
            so that its pulls ride on this step's messages (NOTE [step messages] in
            herald/ps/stepped.py). False by default.

    Per-table views: :attr:`unique_ids`, :attr:`inverse`, :attr:`offsets` (lists of
    views into the flat arrays) and :meth:`values`. The dispatcher builds one from a
    ``SampleBatch`` with :func:`herald.dispatch.microbatch.build_microbatch`.
    """

    step: int
    rank: int
    sample_ids: np.ndarray
    labels: np.ndarray
    dense: np.ndarray
    ids_flat: np.ndarray
    id_bounds: np.ndarray
    inverse_flat: np.ndarray
    offsets_flat: np.ndarray
    plan: CachePlan
    replicated: KeySet = dataclasses.field(default_factory=KeySet.empty)
    pull_early: np.ndarray | None = None
    next_follows: bool = False

    def __post_init__(self) -> None:
        if self.pull_early is None:
            self.pull_early = np.zeros(len(self.plan.pull), bool)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_tables(self) -> int:
        return int(self.id_bounds.shape[0]) - 1

    @functools.cached_property
    def inverse_bounds(self) -> np.ndarray:
        """int64 [T+1]: table t's inverse index is ``inverse_flat[inverse_bounds[t]:inverse_bounds[t+1]]``."""
        out = np.zeros(self.num_tables + 1, np.int64)
        np.cumsum(self.offsets_flat[:, -1], out=out[1:])
        return out

    @functools.cached_property
    def unique_ids(self) -> list[np.ndarray]:
        """Per table, uint64 [u_t] its sorted distinct ids (views of :attr:`ids_flat`)."""
        b = self.id_bounds.tolist()
        return [self.ids_flat[b[t] : b[t + 1]] for t in range(self.num_tables)]

    @functools.cached_property
    def inverse(self) -> list[np.ndarray]:
        """Per table, uint16 or int32 [nnz_t]: value j is ``unique_ids[t][inverse[t][j]]``."""
        b = self.inverse_bounds.tolist()
        return [self.inverse_flat[b[t] : b[t + 1]] for t in range(self.num_tables)]

    @functools.cached_property
    def offsets(self) -> list[np.ndarray]:
        """Per table, int64 [b+1] (rows of :attr:`offsets_flat`)."""
        return list(self.offsets_flat)

    def values(self, table: int) -> np.ndarray:
        """uint64 [nnz_t]: the table's ids per sample, decompressed."""
        return self.unique_ids[table][self.inverse[table]]

    # ------------------------------------------------------------------ wire
    def to_frames(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Header and arrays (one uint8 blob) for :func:`herald.wire.pack`, as NOTE
        [micro-batch layout] describes."""
        p = self.plan
        lists = (p.evict, p.pull, p.grad_push, p.update_local, p.plan_push, self.replicated)
        bounds = np.zeros(_NUM_KEY_LISTS + 1, np.int64)
        np.cumsum([len(k) for k in lists], out=bounds[1:])
        if self.pull_early is None:  # __post_init__ sets it; a caller that cleared it broke the layout
            raise ProtocolError("microbatch: pull_early is None; build micro-batches with build_microbatch")
        parts = [
            self.sample_ids,
            self.labels,
            self.dense,
            self.ids_flat,
            self.id_bounds,
            self.inverse_flat,
            self.offsets_flat,
            np.concatenate([k.table for k in lists]),
            np.concatenate([k.ids for k in lists]),
            bounds,
            p.write_back.astype(np.bool_, copy=False),
            p.contributors.astype(np.uint16, copy=False),
            self.pull_early.astype(np.bool_, copy=False),
        ]
        header = {
            "op": "microbatch",
            "step": self.step,
            "rank": self.rank,
            "tables": self.num_tables,
            "next": bool(self.next_follows),
            "layout": LAYOUT,
            "parts": [[a.dtype.str, list(a.shape)] for a in parts],
        }
        return header, [pack_parts(parts)]

    @classmethod
    def from_frames(cls, header: dict[str, Any], arrays: list[np.ndarray]) -> MicroBatch:
        """Rebuild from :func:`herald.wire.unpack` output (zero copy: views of the blob).

        Checks the layout version, the part descriptors against the blob, every part's
        dtype and shape, the bounds (from 0, non-decreasing, ending at their array's
        length), the offsets (from 0, non-decreasing, adding up to the inverse index),
        the inverse index against its table's distinct ids, and the plan lists' lengths.

        Raises:
            ProtocolError: the message is not a micro-batch of NOTE [micro-batch layout].
        """
        t = header.get("tables")
        if header.get("layout") != LAYOUT:
            raise ProtocolError(
                f"microbatch: layout {header.get('layout')!r:.20}, expected {LAYOUT}; run the same "
                "herald release on the dispatcher and the workers"
            )
        if type(t) is not int or t < 0:
            raise ProtocolError(f"microbatch: 'tables' must be an int >= 0, got {t!r:.20}")
        parts = unpack_parts(header.get("parts"), arrays)
        sample_ids, labels, dense, ids_flat, id_bounds, inverse_flat, offsets_flat = samples = parts[:7]
        _check_samples(t, *samples)
        plan, replicated, pull_early = _plan_from_parts(*parts[7:])
        return cls(
            int(header.get("step", -1)),
            int(header.get("rank", -1)),
            sample_ids,
            labels,
            dense,
            ids_flat,
            id_bounds,
            inverse_flat,
            offsets_flat,
            plan,
            replicated,
            pull_early,
            header.get("next") is True,
        )


def _check_samples(
    t: int,
    sample_ids: np.ndarray,
    labels: np.ndarray,
    dense: np.ndarray,
    ids: np.ndarray,
    id_bounds: np.ndarray,
    inv: np.ndarray,
    offsets: np.ndarray,
) -> None:
    """Check the sample parts of a ``t``-table micro-batch (shapes, bounds, offsets and the
    inverse index against each table's distinct ids: NOTE [micro-batch layout]).

    Raises:
        ProtocolError: naming the first part that is wrong.
    """
    b = labels.shape[0] if labels.ndim == 1 else -1
    _check(sample_ids.shape == (b,), "sample_ids must be uint64 [b]")
    _check(dense.ndim == 2 and dense.shape[0] == b, "labels/dense must be float32 [b] / [b, D]")
    _check(ids.ndim == 1, "ids_flat must be uint64 [U]")
    _check(
        _is_bounds(id_bounds, t + 1, ids.shape[0]),
        "id_bounds must be int64 [T+1] from 0 to len(ids_flat), non-decreasing",
    )
    _check(offsets.shape == (t, b + 1), "offsets_flat must be int64 [T, b+1]")
    _check(inv.ndim == 1, "inverse_flat must be uint16 or int32 [N]")
    if not t:
        _check(inv.shape[0] == 0, "inverse_flat must be empty without tables")
        return
    _check(
        not offsets[:, 0].any() and bool((offsets[:, 1:] >= offsets[:, :-1]).all()),
        "each table's offsets must start at 0 and be non-decreasing",
    )
    nnz = offsets[:, -1]
    _check(int(nnz.sum()) == inv.shape[0], "inverse_flat length must be the sum of the tables' values")
    if inv.shape[0]:
        limit = np.repeat(np.diff(id_bounds), nnz)
        if bool((inv >= limit).any()) or (inv.dtype == np.int32 and bool((inv < 0).any())):
            raise ProtocolError("microbatch: inverse index out of range of its table's distinct ids")


def _plan_from_parts(
    key_table: np.ndarray,
    key_ids: np.ndarray,
    key_bounds: np.ndarray,
    write_back: np.ndarray,
    contributors: np.ndarray,
    pull_early: np.ndarray,
) -> tuple[CachePlan, KeySet, np.ndarray]:
    """The plan, the replicated keys and ``pull_early`` from the key parts of NOTE
    [micro-batch layout], after checking the bounds and the flag arrays' lengths.

    Raises:
        ProtocolError: naming the first part that is wrong.
    """
    _check(key_table.ndim == 1 and key_table.shape == key_ids.shape, "key_table/key_ids must be int32 [K] / uint64 [K]")
    _check(
        _is_bounds(key_bounds, _NUM_KEY_LISTS + 1, key_ids.shape[0]),
        f"key_bounds must be int64 [{_NUM_KEY_LISTS + 1}] from 0 to K, non-decreasing",
    )
    kb = key_bounds.tolist()
    lists = [_keyset(key_table[kb[k] : kb[k + 1]], key_ids[kb[k] : kb[k + 1]]) for k in range(_NUM_KEY_LISTS)]
    evict, pull, grad_push, update_local, plan_push, replicated = lists
    _check(
        write_back.shape == (len(evict),) and contributors.shape == (len(grad_push),),
        "plan: write_back/contributors must be bool/uint16 of the lengths of evict/grad_push",
    )
    _check(pull_early.shape == (len(pull),), "plan: pull_early must be bool of the length of pull")
    plan = CachePlan(evict, write_back, pull, grad_push, contributors, update_local, plan_push)
    return plan, replicated, pull_early


def _aligned(n: int) -> int:
    return (n + 7) & ~7


_PAD = np.zeros(8, np.uint8)


def pack_parts(parts: list[np.ndarray]) -> np.ndarray:
    """uint8 [nbytes]: ``parts`` back to back, each at an offset that is a multiple of 8
    (NOTE [micro-batch layout]); one copy (``np.concatenate``) of every byte."""
    pieces, end = [], 0
    for a in parts:
        pad = -end & 7
        if pad:
            pieces.append(_PAD[:pad])
            end += pad
        v = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        pieces.append(v)
        end += v.shape[0]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)


def unpack_parts(descs: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The parts of a micro-batch blob as views, after checking every descriptor.

    Raises:
        ProtocolError: not one uint8 frame, malformed or unexpected descriptors, or
            sizes that do not add up to the blob's.
    """
    if len(arrays) != 1 or arrays[0].dtype != np.uint8 or arrays[0].ndim != 1:
        raise ProtocolError(f"microbatch: expected one uint8 array (the blob), got {len(arrays)} arrays")
    if type(descs) is not list or len(descs) != _NUM_PARTS:
        raise ProtocolError(f"microbatch: header 'parts' must list {_NUM_PARTS} [dtype, shape] descriptors")
    blob = arrays[0]
    end, spans = 0, []
    for i, (d, allowed) in enumerate(zip(descs, _PART_DTYPES)):
        if not (
            type(d) is list
            and len(d) == 2
            and d[0] in allowed
            and type(d[1]) is list
            and len(d[1]) <= 2
            and all(type(n) is int and 0 <= n < _MAX_DIM for n in d[1])
        ):
            raise ProtocolError(
                f"microbatch: part {i}: descriptor must be [dtype, shape] with dtype in {allowed} "
                f"and at most 2 dims; got {d!r:.80}"
            )
        dtype = _DTYPES[d[0]]
        count = 1
        for n in d[1]:
            count *= n
        start = _aligned(end)
        end = start + count * dtype.itemsize
        spans.append((dtype, d[1], start, count))
    if end != blob.shape[0]:
        raise ProtocolError(f"microbatch: the parts take {end} bytes but the blob has {blob.shape[0]}")
    return [
        np.frombuffer(blob, dtype, count, start).reshape(shape) if count else np.zeros(shape, dtype)
        for dtype, shape, start, count in spans
    ]


def _is_bounds(a: np.ndarray, n: int, end: int) -> bool:
    return (
        a.dtype == np.int64
        and a.shape == (n,)
        and int(a[0]) == 0
        and int(a[-1]) == end
        and bool((a[1:] >= a[:-1]).all())
    )


def _keyset(tab: np.ndarray, ids: np.ndarray) -> KeySet:
    # dtypes and shapes were checked by the caller: set the fields directly
    ks = KeySet.__new__(KeySet)
    ks.table, ks.ids = tab, ids
    return ks


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ProtocolError(f"microbatch: {message}")
