"""The tables of one shard as one store: every op over every table in one kernel call
(a pull in two).

A :class:`TableSet` holds the shard's :class:`~herald.ps.table.EmbeddingTable` s through
their directory (:class:`~herald.ps.directory.TableDirectory`, NOTE [table directory] in
herald/ps/kernels/directory.py: each table's array addresses, row count and settings, so
one numba call serves keys of any tables) and the open gradient aggregations of every
step (NOTE [ps aggregation], :class:`~herald.ps.aggregate.StepAggregations`: one
:class:`~herald.ps.aggregate.PendingStep` per step over all tables). Keys come as flat
``(tables uint16 [n], keys uint64 [n])`` arrays (NOTE [ps wire protocol], flat parts); a
table alone (tests, GBA's apply) is a set of one.

One kernel call serves one part of a request (a pull two: its slots, then its rows, which
a step message's pull reads apart: NOTE [pulls resolved on arrival] in
herald/ps/stepped.py): it validates the keys (tables, shapes, ownership), compares each
table's row count plus its keys with its room (rows allocated, key-map load, NOTE [ps
limits]' ``max_table_bytes``, NOTE [bounded ps]' bound) and, when all fit, does the op. A
table out of room makes the kernel return before any change; its Python path runs
(growth, the byte limits, LRU eviction) and the call is repeated. The set keeps the
shard-wide byte limit (NOTE [ps limits]' ``max_shard_bytes``): the rows allocated over all
its tables (:meth:`TableDirectory.nbytes`), which a table's growth may not take past it
(:meth:`TableDirectory.room_rows`).
"""

from __future__ import annotations

import time

import numpy as np

from herald.errors import ProtocolError
from herald.ps.aggregate import CHECK_MESSAGES, PendingStep, StepAggregations
from herald.ps.directory import ROW_OVERHEAD_BYTES, TableDirectory
from herald.ps.kernels import aggregate as KA
from herald.ps.kernels import directory as KD
from herald.ps.kernels import flat as KF
from herald.ps.kernels.rows import shard_of_jit

__all__ = ["ROW_OVERHEAD_BYTES", "TableSet", "frozen"]  # ROW_OVERHEAD_BYTES: imported from here too

_EMPTY_U64 = np.zeros(0, np.uint64)
_EMPTY_U64.setflags(write=False)


def frozen(a: np.ndarray) -> np.ndarray:
    """``a`` as the kernels take their inputs: aligned, C-contiguous, read-only (a view; a
    copy only when unaligned or strided), so that each kernel has one compiled variant."""
    f = a.flags
    if not (f.aligned and f.c_contiguous):
        a = np.ascontiguousarray(a).copy()
        f = a.flags
    if f.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


class TableSet:
    """The tables of one shard (single-threaded use), addressed by position.

    Args:
        shard, num_shards: the shard the set serves; keys of another shard are refused
            (``num_shards`` 1: every key is the set's).
        max_bytes: NOTE [ps limits]' ``max_shard_bytes``: what all its tables may allocate
            together (:meth:`nbytes`); None: no limit.

    Attributes:
        directory: the tables and their directory (:class:`~herald.ps.directory.TableDirectory`).
        aggregations: the open or recently completed aggregations of every step.
        lru: requests seen: the LRU's time (NOTE [bounded ps]).
    """

    def __init__(self, shard: int = 0, num_shards: int = 1, max_bytes: int | None = None):
        self.directory = TableDirectory(shard, num_shards, max_bytes)
        self.aggregations = StepAggregations(self.directory.tables)
        self._stamp = 0
        self.lru = 0

    def nbytes(self) -> int:
        """Bytes the tables allocated (:meth:`TableDirectory.nbytes`)."""
        return self.directory.nbytes()

    @property
    def open_total(self) -> int:
        """Open aggregations over every table and step."""
        return self.aggregations.open_total

    def next_stamp(self) -> int:
        """A fresh duplicate-detection stamp (one per push request: NOTE [ps wire protocol])."""
        self._stamp = (self._stamp + 1) & 0xFFFFFFFF
        if self._stamp == 0:
            for table in self.directory.tables:
                table.arrays.stamps[:] = 0
            self._stamp = 1
        return self._stamp

    def _make_room(self, tables: np.ndarray, keys: np.ndarray) -> bool:
        """After a kernel's SHORT: the tables without room for every key of theirs in the
        request (the directory's ``counts``) make room for their unseen ones in their Python
        path (:meth:`EmbeddingTable.prepare`: growth, the byte limit, eviction). Returns
        False: call the kernel again without its room check."""
        d, counts = self.directory.d, self.directory.counts
        short = np.flatnonzero(d[:, KD.D_NROWS] + counts > d[:, KD.D_ROOM])
        for t in short.tolist():
            self.directory.tables[t].prepare(keys if counts[t] == keys.shape[0] else keys[tables == t])
        return False

    # ------------------------------------------------------------------ ops
    def slots(
        self, tables: np.ndarray, keys: np.ndarray, dim: int = -1, width: int = -1, op: str = "slots"
    ) -> np.ndarray:
        """Row slots of ``(tables[i], keys[i])`` (int64 [n]), inserting unseen keys; with
        ``dim`` / ``width`` >= 0 every key's table must have that dim / row width.

        Raises:
            ProtocolError: a table unknown or of another shape, a key of another shard,
                NOTE [ps limits]' or NOTE [bounded ps]' bound (nothing inserted then);
                ``op`` names the request in the message.
        """
        room = True
        while True:
            code, i = KD.flat_room_jit(self.directory.space, room, dim, width, tables, keys)
            if code != KD.SHORT:
                break
            room = self._make_room(tables, keys)
        if code:
            fail(self.directory, code, i, tables, keys, op, dim, width)
        out = np.empty(keys.shape[0], np.int64)
        code, i = KD.flat_slots_jit(self.directory.space, tables, keys, out, 0, self.lru, False)
        self.lru += 1
        if code:
            fail(self.directory, code, i, tables, keys, op)
        return out

    def rows_at(self, tables: np.ndarray, slots: np.ndarray, width: int) -> tuple[np.ndarray, int]:
        """A copy of the rows at ``(tables[i], slots[i])`` (float32 [n, width]; slots from
        :meth:`slots` with that width, rows not moved since: NOTE [bounded ps]'s eviction
        moves them), and how many have an open aggregation."""
        out = np.empty((slots.shape[0], width), np.float32)
        return out, int(KF.flat_rows_at_jit(self.directory.d, tables, slots, out, self.open_total > 0))

    def pull(self, tables: np.ndarray, keys: np.ndarray, dim: int, width: int) -> tuple[np.ndarray, int]:
        """Rows of ``(tables[i], keys[i])`` (float32 [n, width]: every table has ``dim`` and
        row width ``width``; duplicates allowed), inserting unseen keys; and how many have an
        open aggregation.

        Raises:
            ProtocolError: a table unknown or of another width, a key of another shard,
                NOTE [ps limits]' or NOTE [bounded ps]' bound (nothing inserted then).
        """
        return self.rows_at(tables, self.slots(tables, keys, dim, width, "pull"), width)

    def pull_clocked(self, tables, keys, dim: int, width: int, c_c: np.ndarray, staleness: int):
        """A conditional pull (NOTE [clock frames]): ``c_c`` uint64 [m <= n] are the cached
        copies' clocks of the first m keys. Returns (c_g uint64 [n], rows of the keys not
        valid in key order, pending)."""
        n = keys.shape[0]
        c_g = np.empty(n, np.uint64)
        out = np.empty((n, width), np.float32)
        slots = np.empty(n, np.int64)
        marks, room = self.open_total > 0, True
        while True:
            code, i, k, pending = KF.flat_pull_clocked_jit(
                self.directory.space, room, tables, keys, dim, c_c, int(staleness), slots, c_g, out, self.lru, marks
            )
            if code != KD.SHORT:
                break
            room = self._make_room(tables, keys)
        self.lru += 1
        if code:
            fail(self.directory, code, i, tables, keys, "pull", dim, width)
        return c_g, out[:k], int(pending)

    def push_rows(self, tables, keys, rows: np.ndarray, advance: np.ndarray | None, stamp: int):
        """Overwrite the rows (float32 [n, width]) of unique keys; with ``advance`` (uint64
        [n]) also c_g += advance, returning c_g after (uint64 [n]), else None. A repeated key
        (this call or an earlier one with the same ``stamp``) raises before any row is written."""
        n = keys.shape[0]
        c_g = np.empty(n if advance is not None else 0, np.uint64)
        slots = np.empty(n, np.int64)
        room = True
        while True:
            code, i = KF.flat_push_rows_jit(
                self.directory.space,
                room,
                tables,
                keys,
                rows,
                _EMPTY_U64 if advance is None else advance,
                advance is not None,
                slots,
                c_g,
                stamp,
                self.lru,
            )
            if code != KD.SHORT:
                break
            room = self._make_room(tables, keys)
        self.lru += 1
        if code:
            fail(self.directory, code, i, tables, keys, "push_rows", -1, rows.shape[1])
        return c_g if advance is not None else None

    def push_grad(
        self, tables, keys, grads, contributors, step: int, rank: int, stamp: int, *, bound=65535, bound_name="65535"
    ) -> tuple[np.ndarray, int]:
        """One contributor's gradients (float32 [n, dim]) with their ``contributors`` (uint16
        [n]) for ``step`` (NOTE [ps aggregation], NOTE [ps limits]), checked and applied in
        one kernel call (:func:`~herald.ps.kernels.aggregate.push_grad_jit`: a request of one
        part). Returns ``(slots, rows updated)``.

        Raises:
            ProtocolError: contributors above ``bound`` (named by ``bound_name``), a
                non-finite gradient, a repeated key (also across calls with the same
                ``stamp``), or a broken aggregation rule; nothing applied then.
        """
        out = self._push(
            KA.push_grad_jit, True, tables, keys, grads, contributors, step, rank, stamp, bound, bound_name
        )
        self.aggregations.settle(step)
        return out

    def check_grad(
        self, tables, keys, grads, contributors, step: int, rank: int, stamp: int, *, bound=65535, bound_name="65535"
    ) -> tuple[np.ndarray, int]:
        """Validate one part of a push as :meth:`push_grad` does without changing a row
        (unseen keys are inserted; :func:`~herald.ps.kernels.aggregate.push_grad_check_jit`);
        returns ``(slots, largest contributors)`` for :meth:`apply_grad`, called once every
        part of the request is checked (and :meth:`reserve_step` when a part has more than
        one contributor).

        Raises:
            ProtocolError: as :meth:`push_grad`.
        """
        kernel = KA.push_grad_check_jit
        return self._push(kernel, False, tables, keys, grads, contributors, step, rank, stamp, bound, bound_name)

    def _push(self, kernel, timed, tables, keys, grads, contributors, step, rank, stamp, bound, bound_name):
        """Call a push kernel (``timed``: with the time an opened aggregation starts) until it
        is done: room made on SHORT (bad inputs refused first), the step's state on
        NEED_STATE; a refusal raises. Returns ``(slots, the kernel's value)``."""
        self._check_aborted(step, tables)
        n = keys.shape[0]
        slots = np.empty(n, np.int64)
        room = True
        while True:
            space, state = self.directory.space, self._state(step).state
            args = (
                space,
                room,
                tables,
                keys,
                grads,
                contributors,
                int(rank),
                int(bound),
                slots,
                stamp,
                self.lru,
                state,
            )
            code, i, value = kernel(*args, time.monotonic()) if timed else kernel(*args)
            if code == KD.SHORT:
                room = self._room_for_grads(tables, keys, grads, contributors, step, rank, bound, bound_name)
            elif code == KD.NEED_STATE:
                self.reserve_step(step, n, grads.shape[1])
            else:
                break
        self.lru += 1
        if code:
            refuse(self.directory, code, i, tables, keys, contributors, step, rank, bound_name)
        return slots, int(value)

    def apply_grad(self, tables, keys, grads, contributors, step: int, rank: int, slots: np.ndarray) -> int:
        """Apply what :meth:`check_grad` accepted (its ``slots``); returns the rows updated
        (:func:`~herald.ps.kernels.aggregate.push_grad_apply_jit`)."""
        state = self._state(step).state
        space = self.directory.space
        applied = KA.push_grad_apply_jit(
            space, tables, keys, grads, contributors, int(rank), slots, state, time.monotonic()
        )
        self.aggregations.settle(step)
        return int(applied)

    def _state(self, step: int) -> PendingStep:
        """The pending state of ``step``, or the empty one of a step without any."""
        state = self.aggregations.state_of(step)
        return state if state is not None else self.aggregations.no_step

    def _check_aborted(self, step: int, tables: np.ndarray) -> None:
        """Refuse a push to a table whose aggregation of ``step`` was aborted (NOTE [ps aggregation])."""
        state = self.aggregations.state_of(step)
        if state is not None and state.aborted:
            state.check_aborted(np.bincount(tables, minlength=self.directory.n_tables))

    def _room_for_grads(self, tables, keys, grads, contributors, step, rank, bound, bound_name) -> bool:
        """A push's SHORT: growth or eviction ahead, so bad inputs are refused first (nothing
        is changed for them); then :meth:`_make_room`."""
        bad, j, _ = KA.grad_inputs_check_jit(grads, contributors, int(bound))
        if bad != KD.OK:
            refuse(self.directory, bad, j, tables, keys, contributors, step, rank, bound_name)
        return self._make_room(tables, keys)

    def reserve_step(self, step: int, n: int, dim: int) -> PendingStep:
        """The pending state of ``step`` (made if missing) with room for ``n`` more keys."""
        return self.aggregations.reserve(step, n, dim, self.directory.dims)


def fail(
    directory: TableDirectory,
    code: int,
    i: int,
    tables: np.ndarray,
    keys: np.ndarray,
    op: str,
    dim: int = -1,
    width: int = -1,
) -> None:
    """Raise the :class:`ProtocolError` of a flat kernel's ``code`` at key ``i``."""
    t = int(tables[i])
    if code == KD.UNKNOWN_TABLE:
        raise ProtocolError(f"{op}: unknown table {t}; this shard has {directory.n_tables} tables (declare them first)")
    name = directory.tables[t].cfg.name
    key = int(keys[i])
    if code == KD.WRONG_SHAPE:
        raise ProtocolError(
            f"{op}: table {name!r} has dim {int(directory.dims[t])} and row width "
            f"{int(directory.widths[t])}, not the {dim} and {width} of its part; send tables of "
            "another shape in another part"
        )
    if code == KD.NOT_OWNED:
        salt, shards, shard = directory.salts[t], directory.num_shards, directory.shard
        owner = int(shard_of_jit(salt, keys[i : i + 1], shards, np.empty(1, np.int64))[0])
        raise ProtocolError(
            f"{op}: key {key} of table {t} belongs to shard {owner}, not {shard}; route keys with shard_of()"
        )
    if code == KD.DUPLICATE:
        raise ProtocolError(
            f"{op} on table {name!r}: key {key} appears twice; send each key once per request (sum its gradients first)"
        )
    if code == KD.NONFINITE:
        raise ProtocolError(
            f"{op} on table {name!r}: the row of key {key} holds NaN or infinity; nothing "
            "was stored: the sender's copy diverged (lower the learning rate, or clip the "
            "gradients, and continue from the last checkpoint)"
        )
    raise ProtocolError(f"{op} on table {name!r}: internal error {code} at key {key}")


def refuse(directory: TableDirectory, code, i, tables, keys, contributors, step, rank, bound_name) -> None:
    """Raise the :class:`ProtocolError` of a push_grad check's ``code`` at key ``i``."""
    if code in (KD.UNKNOWN_TABLE, KD.NOT_OWNED, KD.WRONG_SHAPE, KD.DUPLICATE, KD.FULL):
        fail(directory, code, i, tables, keys, "push_grad")
    t = directory.tables[int(tables[i])]
    key = int(keys[i])
    if code == KD.ABOVE_BOUND:
        raise ProtocolError(
            f"push_grad: contributors {int(contributors[i])} of key {key} in table "
            f"{t.cfg.name!r} exceed {bound_name}; a key has at most one contributor per "
            "worker (NOTE [ps aggregation])"
        )
    if code == KD.NONFINITE:
        raise ProtocolError(
            f"push_grad: the gradient of key {key} in table {t.cfg.name!r} (step {step}, "
            f"rank {rank}) holds NaN or infinity; nothing was stored: fix the model's loss "
            "(or clip the gradients) first"
        )
    if code in CHECK_MESSAGES:
        raise ProtocolError(
            f"push_grad rejected: {CHECK_MESSAGES[code]} (key {key}, rank {rank}); see NOTE [ps aggregation]"
        )
    fail(directory, code, i, tables, keys, "push_grad")
