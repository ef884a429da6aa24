"""The tables of one shard as one store: every op over every table in one kernel call
(a pull in two).

A :class:`TableSet` holds the shard's :class:`~herald.ps.table.EmbeddingTable` s, their
directory (NOTE [table directory] in herald/ps/kernels.py: each table's array addresses,
row count and settings, so one numba call serves keys of any tables) and the open
gradient aggregations of every step (NOTE [ps aggregation], one
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
its tables (:meth:`TableSet.nbytes`), which a table's growth may not take past it
(:meth:`TableSet.room_rows`).
"""

from __future__ import annotations

import time

import numpy as np

from herald.errors import ProtocolError
from herald.ps import kernels as K
from herald.ps.aggregate import CHECK_MESSAGES, PendingStep
from herald.ps.config import MAX_TABLES
from herald.ps.rows import table_salt

#: Completed steps whose key maps are kept to reject late contributions (NOTE [ps aggregation]).
RETAIN_STEPS = 4
#: Bytes a table allocates per row besides the row itself (NOTE [ps limits]' max_shard_bytes):
#: its key, open-aggregation mark, stamp, last use and clock (8 + 4 + 4 + 8 + 8) and at most
#: 64 of key map (at most 8 int64 buckets per allocated row: herald/ps/table.py).
ROW_OVERHEAD_BYTES = 96
_NO_ROOM = np.iinfo(np.int64).max
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
        tables: the :class:`EmbeddingTable` s, by position.
        d: the directory, int64 [T, ``K.D_COLS``] (NOTE [table directory]).
        pending: ``{step: PendingStep}``, open or recently completed aggregations.
        counts: int64 [T]: keys per table of the last request (written by the kernels).
    """

    def __init__(self, shard: int = 0, num_shards: int = 1, max_bytes: int | None = None):
        self.shard, self.num_shards = int(shard), int(num_shards)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.tables: list = []
        self.d = np.zeros((0, K.D_COLS), np.int64)
        self.seeds = np.zeros(0, np.uint64)
        self.salts = np.zeros(0, np.uint64)
        self.fparams = np.zeros((0, 2), np.float64)
        self.hp = np.zeros((0, 5), np.float32)
        self.counts = np.zeros(0, np.int64)
        self.pending: dict[int, PendingStep] = {}
        self._retired: list[int] = []
        self._stamp = 0
        self._hint = 0  # entries of the last completed step: a new step's first size
        self.lru = 0  # requests seen: the LRU's time (NOTE [bounded ps])
        #: whether a table is LRU-bounded (NOTE [bounded ps]): its rows may move
        self.bounded = False
        self._no_step = PendingStep(1, 0)

    # ------------------------------------------------------------------ directory
    def add(self, table) -> int:
        """Append ``table``; returns its position."""
        t = len(self.tables)
        if t >= MAX_TABLES:
            raise ProtocolError(f"a shard holds at most {MAX_TABLES} tables")
        self.tables.append(table)
        self.d = np.concatenate([self.d, np.zeros((1, K.D_COLS), np.int64)])
        self.seeds = np.append(self.seeds, np.uint64(table.init_args[0]))
        self.salts = np.append(self.salts, table_salt(t))
        self.fparams = np.concatenate([self.fparams, [[table.init_args[3], table.init_args[5]]]])
        self.hp = np.concatenate([self.hp, table.hp[None, :]])
        self.counts = np.zeros(t + 1, np.int64)
        row = self.d[t]
        row[K.D_WIDTH], row[K.D_DIM] = table.width, table.cfg.dim
        row[K.D_INIT], row[K.D_STATE] = table.init_args[2], table.init_args[4]
        row[K.D_OPT], row[K.D_BOUNDED] = table.cfg.optimizer.kind, table.max_resident is not None
        self.bounded = self.bounded or table.max_resident is not None
        return t

    def publish(self, t: int) -> None:
        """Write table ``t``'s array addresses, sizes and room into the directory: after any
        change of its arrays (NOTE [table directory])."""
        table, row = self.tables[t], self.d[t]
        row[K.D_ROWS] = table.rows.ctypes.data
        row[K.D_KEYS] = table.row_keys.ctypes.data
        row[K.D_BUCKETS] = table.buckets.ctypes.data
        row[K.D_MARKS] = table.row_marks.ctypes.data
        row[K.D_STAMPS] = table.stamps.ctypes.data
        row[K.D_USED] = table.last_used.ctypes.data
        row[K.D_CLOCKS] = table.clocks.ctypes.data
        cap = table.rows.shape[0]
        row[K.D_CAP], row[K.D_NBUCKETS] = cap, table.buckets.shape[0]
        room = min(cap, table.buckets.shape[0] // 2)
        for bound in (table.max_rows, table.max_resident):
            if bound is not None:
                room = min(room, bound)
        row[K.D_ROOM] = room

    @property
    def n_tables(self) -> int:
        return len(self.tables)

    def nbytes(self) -> int:
        """Bytes the tables allocated (NOTE [ps limits]' ``max_shard_bytes``): each one's
        allocated rows times (4 x row width + :data:`ROW_OVERHEAD_BYTES`)."""
        return int((self.d[:, K.D_CAP] * (4 * self.d[:, K.D_WIDTH] + ROW_OVERHEAD_BYTES)).sum())

    def room_rows(self, t: int) -> int | None:
        """Most rows table position ``t`` may allocate with the others' as they are (None:
        no ``max_bytes``); at least its allocated rows while the limit holds."""
        if self.max_bytes is None:
            return None
        row_bytes = 4 * int(self.d[t, K.D_WIDTH]) + ROW_OVERHEAD_BYTES
        others = self.nbytes() - int(self.d[t, K.D_CAP]) * row_bytes
        return max(0, self.max_bytes - others) // row_bytes

    def check_bytes(self, total: int, what: str) -> None:
        """Raise :class:`ProtocolError` if ``total`` bytes over all tables (after ``what``)
        pass ``max_bytes``."""
        if self.max_bytes is not None and total > self.max_bytes:
            raise ProtocolError(
                f"{what} would take the tables of this shard to {total} bytes, past its "
                f"max_shard_bytes={self.max_bytes}; add PS shards or raise --max-shard-bytes"
            )

    @property
    def dims(self) -> np.ndarray:
        return self.d[:, K.D_DIM]

    @property
    def widths(self) -> np.ndarray:
        return self.d[:, K.D_WIDTH]

    def positions(self, t: int, n: int) -> np.ndarray:
        """uint16 [n] of table position ``t`` (the tables array of a one-table part)."""
        out = np.full(n, t, np.uint16)
        out.setflags(write=False)
        return out

    def next_stamp(self) -> int:
        """A fresh duplicate-detection stamp (one per push request: NOTE [ps wire protocol])."""
        self._stamp = (self._stamp + 1) & 0xFFFFFFFF
        if self._stamp == 0:
            for table in self.tables:
                table.stamps[:] = 0
            self._stamp = 1
        return self._stamp

    def _head(self, check_room: bool) -> tuple:
        """The leading arguments of every flat kernel (directory, initialisers, ownership,
        whether to check the tables' room)."""
        return self.d, self.seeds, self.fparams, self.salts, self.num_shards, self.shard, self.counts, check_room

    def _make_room(self, tables: np.ndarray, keys: np.ndarray) -> bool:
        """After a kernel's SHORT: the tables without room for every key of theirs in the
        request (:attr:`counts`) make room for their unseen ones in their Python path
        (:meth:`EmbeddingTable.prepare`: growth, the byte limit, eviction). Returns False:
        call the kernel again without its room check."""
        counts = self.counts
        short = np.flatnonzero(self.d[:, K.D_NROWS] + counts > self.d[:, K.D_ROOM])
        for t in short.tolist():
            self.tables[t].prepare(keys if counts[t] == keys.shape[0] else keys[tables == t])
        return False

    def _fail(
        self, code: int, i: int, tables: np.ndarray, keys: np.ndarray, op: str, dim: int = -1, width: int = -1
    ) -> None:
        """Raise the :class:`ProtocolError` of a flat kernel's ``code`` at key ``i``."""
        t = int(tables[i])
        if code == K.UNKNOWN_TABLE:
            raise ProtocolError(f"{op}: unknown table {t}; this shard has {self.n_tables} tables (declare them first)")
        name = self.tables[t].cfg.name
        key = int(keys[i])
        if code == K.WRONG_SHAPE:
            raise ProtocolError(
                f"{op}: table {name!r} has dim {int(self.dims[t])} and row width "
                f"{int(self.widths[t])}, not the {dim} and {width} of its part; send tables of "
                "another shape in another part"
            )
        if code == K.NOT_OWNED:
            owner = int(K.shard_of_jit(self.salts[t], keys[i : i + 1], self.num_shards, np.empty(1, np.int64))[0])
            raise ProtocolError(
                f"{op}: key {key} of table {t} belongs to shard {owner}, not {self.shard}; route keys with shard_of()"
            )
        if code == K.DUPLICATE:
            raise ProtocolError(
                f"{op} on table {name!r}: key {key} appears twice; "
                "send each key once per request (sum its gradients first)"
            )
        if code == K.NONFINITE:
            raise ProtocolError(
                f"{op} on table {name!r}: the row of key {key} holds NaN or infinity; nothing "
                "was stored: the sender's copy diverged (lower the learning rate, or clip the "
                "gradients, and continue from the last checkpoint)"
            )
        raise ProtocolError(f"{op} on table {name!r}: internal error {code} at key {key}")

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
            code, i = K.flat_room_jit(
                self.d, self.salts, self.num_shards, self.shard, dim, width, tables, keys, self.counts, room
            )
            if code != K.SHORT:
                break
            room = self._make_room(tables, keys)
        if code:
            self._fail(code, i, tables, keys, op, dim, width)
        out = np.empty(keys.shape[0], np.int64)
        code, i = K.flat_slots_jit(self.d, self.seeds, self.fparams, tables, keys, out, 0, self.lru, False)
        self.lru += 1
        if code:
            self._fail(code, i, tables, keys, op)
        return out

    def rows_at(self, tables: np.ndarray, slots: np.ndarray, width: int) -> tuple[np.ndarray, int]:
        """A copy of the rows at ``(tables[i], slots[i])`` (float32 [n, width]; slots from
        :meth:`slots` with that width, rows not moved since: NOTE [bounded ps]'s eviction
        moves them), and how many have an open aggregation."""
        out = np.empty((slots.shape[0], width), np.float32)
        return out, int(K.flat_rows_at_jit(self.d, tables, slots, out, self.open_total > 0))

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
            code, i, k, pending = K.flat_pull_clocked_jit(
                *self._head(room), tables, keys, dim, c_c, int(staleness), slots, c_g, out, self.lru, marks
            )
            if code != K.SHORT:
                break
            room = self._make_room(tables, keys)
        self.lru += 1
        if code:
            self._fail(code, i, tables, keys, "pull", dim, width)
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
            code, i = K.flat_push_rows_jit(
                *self._head(room),
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
            if code != K.SHORT:
                break
            room = self._make_room(tables, keys)
        self.lru += 1
        if code:
            self._fail(code, i, tables, keys, "push_rows", -1, rows.shape[1])
        return c_g if advance is not None else None

    def push_grad(
        self,
        tables,
        keys,
        grads,
        contributors,
        step: int,
        rank: int,
        stamp: int,
        *,
        mode: int = K.CHECK_AND_APPLY,
        slots: np.ndarray | None = None,
        bound: int = 65535,
        bound_name: str = "65535",
    ) -> tuple[np.ndarray, int]:
        """One contributor's gradients (float32 [n, dim]) with their ``contributors`` (uint16
        [n]) for ``step`` (NOTE [ps aggregation], NOTE [ps limits]).

        ``mode`` (:func:`~herald.ps.kernels.flat_push_grad_jit`): CHECK_AND_APPLY (one
        request of one part) returns ``(slots, rows updated)``; CHECK_ONLY validates without
        changing a row (unseen keys are inserted) and returns ``(slots, largest
        contributors)``; APPLY_ONLY applies what CHECK_ONLY accepted (its ``slots``; call
        :meth:`reserve_step` first) and returns ``(slots, rows updated)``.

        Raises:
            ProtocolError: contributors above ``bound`` (named by ``bound_name``), a
                non-finite gradient, a repeated key (also across calls with the same
                ``stamp``), or a broken aggregation rule; nothing applied then.
        """
        n = keys.shape[0]
        state = self.pending.get(step)
        if state is not None and state.aborted and mode != K.APPLY_ONLY:
            state.check_aborted(self._counts_of(tables))
        slots = np.empty(n, np.int64) if slots is None else slots
        room = True
        while True:
            st = state if state is not None else self._no_step
            code, i, value = K.flat_push_grad_jit(
                *self._head(room),
                self.hp,
                tables,
                keys,
                grads,
                contributors,
                int(rank),
                int(bound),
                slots,
                stamp,
                self.lru,
                mode,
                *st.apply_args(),
                time.monotonic(),
            )
            if code == K.SHORT:
                # growth or eviction ahead: refuse bad inputs first (nothing is changed for them)
                bad, j, _ = K.grad_inputs_check_jit(grads, contributors, int(bound))
                if bad != K.OK:
                    self._refuse(bad, j, tables, keys, contributors, step, rank, bound_name)
                room = self._make_room(tables, keys)
            elif code == K.NEED_STATE:
                state = self.reserve_step(step, n, grads.shape[1])
            else:
                break
        if mode != K.APPLY_ONLY:
            self.lru += 1
        if code:
            self._refuse(code, i, tables, keys, contributors, step, rank, bound_name)
        if mode != K.CHECK_ONLY and state is not None and state.open == 0:
            self._retire(step)
        return slots, int(value)

    def reserve_step(self, step: int, n: int, dim: int) -> PendingStep:
        """The pending state of ``step`` (made if missing) with room for ``n`` more keys."""
        state = self.pending.get(step)
        if state is None:
            # sized for the last completed step's entries and a quarter more: a step's size
            # varies, and each growth copies the state and rebuilds its key map
            state = self.pending[step] = PendingStep(
                max(int(self.dims.max()), dim), self.n_tables, max(n, self._hint + self._hint // 4)
            )
        state.reserve(n, dim, self.n_tables)
        return state

    def _counts_of(self, tables: np.ndarray) -> np.ndarray:
        return np.bincount(tables, minlength=self.n_tables)

    def _refuse(self, code, i, tables, keys, contributors, step, rank, bound_name) -> None:
        """Raise the :class:`ProtocolError` of a push_grad check's ``code`` at key ``i``."""
        if code in (K.UNKNOWN_TABLE, K.NOT_OWNED, K.WRONG_SHAPE, K.DUPLICATE, K.FULL):
            self._fail(code, i, tables, keys, "push_grad")
        t = self.tables[int(tables[i])]
        key = int(keys[i])
        if code == K.ABOVE_BOUND:
            raise ProtocolError(
                f"push_grad: contributors {int(contributors[i])} of key {key} in table "
                f"{t.cfg.name!r} exceed {bound_name}; a key has at most one contributor per "
                "worker (NOTE [ps aggregation])"
            )
        if code == K.NONFINITE:
            raise ProtocolError(
                f"push_grad: the gradient of key {key} in table {t.cfg.name!r} (step {step}, "
                f"rank {rank}) holds NaN or infinity; nothing was stored: fix the model's loss "
                "(or clip the gradients) first"
            )
        if code in CHECK_MESSAGES:
            raise ProtocolError(
                f"push_grad rejected: {CHECK_MESSAGES[code]} (key {key}, rank {rank}); see NOTE [ps aggregation]"
            )
        self._fail(code, i, tables, keys, "push_grad")

    # ------------------------------------------------------------------ aggregations
    @property
    def open_total(self) -> int:
        """Open aggregations over every table and step."""
        return sum(int(s.cnt[2]) for s in self.pending.values()) if self.pending else 0

    def open_of(self, t: int) -> int:
        """Open aggregations of table position ``t``."""
        return sum(int(s.open_t[t]) for s in self.pending.values() if t < s.open_t.shape[0])

    def _retire(self, step: int) -> None:
        """A step without open aggregations keeps its key map (so late or repeated
        contributions are still rejected) but frees its gradients; only the last
        ``RETAIN_STEPS`` such steps are kept."""
        state = self.pending[step]
        self._hint = int(state.cnt[1])
        state.free_gradients()
        if step in self._retired:
            self._retired.remove(step)
        self._retired.append(step)
        while len(self._retired) > RETAIN_STEPS:
            old = self._retired.pop(0)
            if old in self.pending and self.pending[old].open == 0:
                del self.pending[old]

    def expire(self, now: float, timeout_s: float, only: int | None = None) -> list[dict]:
        """Abort the (table, step) aggregations open longer than ``timeout_s`` (NOTE [ps
        aggregation]), of every table or of position ``only``; returns one report per
        aborted (table, step): ``table`` (name), ``step``, ``open_keys`` dropped,
        ``contributors`` expected, ``waited_ms``, ``missing_ranks`` (None here: the caller,
        who knows the ranks that pushed, fills it in place)."""
        out = []
        for step, state in list(self.pending.items()):
            if not state.open:
                continue
            late = (state.open_t > 0) & (now - state.opened_at >= timeout_s)
            for t in np.flatnonzero(late).tolist():
                if only is not None and t != only:
                    continue
                waited = int((now - state.opened_at[t]) * 1000)
                dropped, expected = state.abort(t, self.tables[t].row_marks)
                report = {
                    "table": self.tables[t].cfg.name,
                    "step": int(step),
                    "open_keys": dropped,
                    "contributors": expected,
                    "waited_ms": waited,
                    "missing_ranks": None,
                }
                state.aborted[t] = report
                out.append(report)
            if state.open == 0:
                self._retire(step)
        return out

    def forget(self, t: int) -> None:
        """Drop every aggregation state of table position ``t`` (its rows were replaced)."""
        for step, state in list(self.pending.items()):
            state.forget(t)
            if not (state.p_table[: int(state.cnt[0])] >= 0).any():
                del self.pending[step]
                if step in self._retired:
                    self._retired.remove(step)
            elif state.open == 0:
                self._retire(step)

    def remap(self, t: int, new_of_old: np.ndarray) -> None:
        """Rows of table position ``t`` moved (NOTE [bounded ps]): remap its pending slots."""
        for state in self.pending.values():
            state.remap(t, new_of_old)
