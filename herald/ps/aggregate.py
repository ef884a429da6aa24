"""Pending gradient aggregation of one step over the tables of a shard.

NOTE [ps aggregation] (docs/design.md, "Consistency protocol"; NOTE [step protocol] in
herald/contracts/plan.py, step 4). A ``push_grad`` carries, per key, the number of
workers that push that key in this step (``contributors``) and the pusher's ``rank``.
The shard keeps each contribution of (key, step) until ``contributors`` distinct ranks
have arrived, then sums them in increasing rank order and applies the optimizer once.
The sum order makes the result bit-identical whatever the arrival order. Rules:

- ``contributors == 1`` and nothing pending for (key, step): applied at once.
- every contribution to one (key, step) must carry the same ``contributors``;
- a rank contributes at most once to a (key, step); a contribution to a completed
  (key, step) is rejected (the request is rejected whole, before any change);
- the ack is sent on receipt: the pusher does not wait for the other contributors.
- a pull of a key with an open aggregation is a caller bug (the step protocol puts the
  next pull after every push of the step): the shard serves the current row and counts
  it in ``stats()["pull_pending_keys"]``.
- when a step has no open (key, step) left on the shard (any table), its gradients are
  freed but its key map is kept for the last ``RETAIN_STEPS`` (4) such steps, so a late
  or repeated contribution to a completed (key, step) is still rejected; older completed
  steps are forgotten.
- ``contributors`` is at most the job's workers and ``rank`` below it (NOTE [ps limits]:
  ``max_contributors``, or the ``workers`` of a declare); a gradient holding a NaN or
  an infinity is refused whole (nothing stored).
- one step's state holds every table's keys (one map of (table, key), one kernel call per
  request: :class:`PendingStep`); what opens, expires and aborts is still per (table,
  step).
- an aggregation still open ``aggregation_timeout_ms`` after its (table, step) opened
  (a rank died, or a caller declared a contributor that never pushes) is aborted: its
  rows are unmarked and its gradients dropped, the shard counts it
  (``stats()["counters"]["aggregations_aborted"]``), logs it and lists it in
  ``stats()["aborted"]`` with the ranks that did not push, and every later push to
  that (table, step) is rejected. Checkpoints are accepted again.
"""

from __future__ import annotations

import numpy as np

from herald import keymap
from herald.errors import ProtocolError
from herald.ps.kernels.directory import AGG_COMPLETE, AGG_DIFFER, AGG_TWICE, AGG_ZERO

#: kernel codes of :func:`~herald.ps.kernels.aggregate.push_grad_check_jit` -> the rule broken
CHECK_MESSAGES = {
    AGG_ZERO: "contributors must be >= 1",
    AGG_DIFFER: "contributors differ from an earlier contribution to the same (key, step)",
    AGG_COMPLETE: "(key, step) already received all its contributions",
    AGG_TWICE: "this rank already contributed to (key, step)",
}
#: The arrays of a step's state, in the order of the kernels' ``agg`` tuple
#: (herald/ps/kernels/aggregate.py).
STATE_FIELDS = (
    "buckets",
    "p_key",
    "p_table",
    "p_slot",
    "p_expected",
    "p_arrived",
    "p_head",
    "e_rank",
    "e_next",
    "e_grad",
    "cnt",
    "open_t",
    "opened_at",
)
#: Completed steps whose key maps are kept to reject late contributions (NOTE [ps aggregation]).
RETAIN_STEPS = 4


class PendingStep:
    """Open aggregations of one step over the tables of a shard (the kernels' layout:
    herald/ps/kernels/aggregate.py): keyed by (table, key).

    Args:
        dim: widest gradient kept (grows with :meth:`reserve`).
        num_tables: tables of the shard (grows with :meth:`reserve`).
        capacity: pending keys and entries to allocate for.

    Attributes:
        aborted: ``{table position: report}`` of the tables whose open aggregations of this
            step were aborted (NOTE [ps aggregation]): later pushes to them are refused.
        state: the arrays of :data:`STATE_FIELDS` as the kernels take them (``agg``), rebuilt
            whenever one is replaced (:meth:`reserve`, :meth:`free_gradients`).
    """

    def __init__(self, dim: int, num_tables: int, capacity: int = 0):
        self.dim = int(dim)
        cap = max(int(capacity), 0)
        self.p_key = np.zeros(cap, np.uint64)
        self.p_table = np.zeros(cap, np.int32)
        self.p_slot = np.zeros(cap, np.int64)
        self.p_expected = np.zeros(cap, np.int32)
        self.p_arrived = np.zeros(cap, np.int32)
        self.p_head = np.zeros(cap, np.int64)
        self.buckets = keymap.new_buckets(cap, self.p_key, self.p_table, 0, np.int64)
        self.e_rank = np.zeros(cap, np.int32)
        self.e_next = np.zeros(cap, np.int64)
        self.e_grad = np.zeros((cap, self.dim), np.float32)
        self.cnt = np.zeros(3, np.int64)
        self.open_t = np.zeros(num_tables, np.int64)
        #: ``time.monotonic()`` when each table's open count last left 0
        self.opened_at = np.zeros(num_tables, np.float64)
        self.aborted: dict[int, dict] = {}
        self.state = self._state()

    def _state(self) -> tuple:
        """The kernels' ``agg`` tuple of the arrays held now, in the order of :data:`STATE_FIELDS`
        (spelled out: it is rebuilt on every growth of a step's state)."""
        return (
            self.buckets,
            self.p_key,
            self.p_table,
            self.p_slot,
            self.p_expected,
            self.p_arrived,
            self.p_head,
            self.e_rank,
            self.e_next,
            self.e_grad,
            self.cnt,
            self.open_t,
            self.opened_at,
        )

    @property
    def open(self) -> int:
        return int(self.cnt[2])

    def abort(self, t: int, marks: np.ndarray) -> tuple[int, list[int]]:
        """Drop every open aggregation of table position ``t``: unmark its rows in ``marks``
        (int32 [rows], the table's ``row_marks``).

        Returns (open keys dropped, the distinct ``contributors`` they expected).
        """
        n = int(self.cnt[0])
        idx = np.flatnonzero((self.p_table[:n] == t) & (self.p_arrived[:n] < self.p_expected[:n]))
        np.subtract.at(marks, self.p_slot[idx], 1)
        self.p_arrived[idx] = self.p_expected[idx]  # nothing open is left
        self.cnt[2] -= idx.size
        self.open_t[t] = 0
        return int(idx.size), sorted(set(self.p_expected[idx].tolist()))

    def forget(self, t: int) -> None:
        """Drop everything of table position ``t`` (its rows were replaced: a restore): its
        open aggregations are closed and its keys never match again (table -1)."""
        n = int(self.cnt[0])
        idx = np.flatnonzero(self.p_table[:n] == t)
        self.cnt[2] -= int(np.count_nonzero(self.p_arrived[idx] < self.p_expected[idx]))
        self.p_arrived[idx] = self.p_expected[idx]
        self.p_table[idx] = -1
        self.open_t[t] = 0
        self.aborted.pop(t, None)

    def remap(self, t: int, new_of_old: np.ndarray) -> None:
        """Rows of table position ``t`` moved (NOTE [bounded ps]): ``p_slot = new_of_old[p_slot]``
        for its pending keys (completed ones may go -1: never read again)."""
        n = int(self.cnt[0])
        idx = np.flatnonzero(self.p_table[:n] == t)
        self.p_slot[idx] = new_of_old[self.p_slot[idx]]

    def reserve(self, n: int, dim: int, num_tables: int) -> None:
        """Room for ``n`` more pending keys and entries, gradients of ``dim`` values and
        ``num_tables`` tables (:attr:`state` rebuilt when an array is replaced)."""
        replaced = False
        need_p = int(self.cnt[0]) + n
        if need_p > self.p_key.shape[0]:
            self._grow(("p_key", "p_table", "p_slot", "p_expected", "p_arrived", "p_head"), need_p)
            replaced = True
        if 2 * need_p > self.buckets.shape[0]:
            self.buckets = keymap.new_buckets(need_p, self.p_key, self.p_table, int(self.cnt[0]), np.int64)
            replaced = True
        need_e = int(self.cnt[1]) + n
        if need_e > self.e_rank.shape[0]:
            self._grow(("e_rank", "e_next"), need_e)
            replaced = True
        if self.e_grad.shape[0] < self.e_rank.shape[0] or dim > self.dim:  # grown, or freed by a retired step
            self.dim = max(self.dim, int(dim))
            g = np.zeros((self.e_rank.shape[0], self.dim), np.float32)
            g[: self.e_grad.shape[0], : self.e_grad.shape[1]] = self.e_grad
            self.e_grad = g
            replaced = True
        if num_tables > self.open_t.shape[0]:
            self.open_t = np.concatenate([self.open_t, np.zeros(num_tables - self.open_t.shape[0], np.int64)])
            self.opened_at = np.concatenate([self.opened_at, np.zeros(num_tables - self.opened_at.shape[0])])
            replaced = True
        if replaced:
            self.state = self._state()

    def _grow(self, names: tuple[str, ...], need: int) -> None:
        """The arrays ``names`` (of one length) reallocated for at least ``need`` entries."""
        cap = max(need, 2 * getattr(self, names[0]).shape[0], 64)
        for name in names:
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def free_gradients(self) -> None:
        """Free the gradients of a step without open aggregations (its key map stays)."""
        self.e_grad = np.zeros((0, self.dim), np.float32)
        self.state = self._state()

    def check_aborted(self, counts: np.ndarray) -> None:
        """Raise :class:`ProtocolError` if a table with keys in ``counts`` (int64 [T], keys
        per table position) had this step's aggregations aborted (NOTE [ps aggregation])."""
        for t, a in self.aborted.items():
            if t < counts.shape[0] and counts[t]:
                raise ProtocolError(
                    f"push_grad rejected: the aggregation of step {a['step']} on table "
                    f"{a['table']!r} was aborted after {a['waited_ms']} ms (ranks that did not "
                    f"push: {a['missing_ranks']}); restore the latest checkpoint and resume; "
                    "see NOTE [ps aggregation]"
                )


class StepAggregations:
    """The open (or recently completed) aggregations of every step on a shard (NOTE [ps
    aggregation]): one :class:`PendingStep` per step over all its tables.

    Args:
        tables: the shard's tables by position (the directory's list, shared): their names
            and row marks (an abort unmarks its rows).

    Attributes:
        pending: ``{step: PendingStep}``.
    """

    def __init__(self, tables: list):
        self.tables = tables
        self.pending: dict[int, PendingStep] = {}
        self._retired: list[int] = []
        self._hint = 0  # entries of the last completed step: a new step's first size
        #: the state of a step with none yet (a push whose keys all have one contributor)
        self.no_step = PendingStep(1, 0)

    def state_of(self, step: int) -> PendingStep | None:
        """The pending state of ``step``, or None."""
        return self.pending.get(step)

    def reserve(self, step: int, n: int, dim: int, dims: np.ndarray) -> PendingStep:
        """The pending state of ``step`` (made if missing, for gradients as wide as the widest
        of ``dims``, the tables' dims) with room for ``n`` more keys of ``dim`` values."""
        state = self.pending.get(step)
        if state is None:
            # sized for the last completed step's entries and a quarter more: a step's size
            # varies, and each growth copies the state and rebuilds its key map
            state = self.pending[step] = PendingStep(
                max(int(dims.max()), dim), len(self.tables), max(n, self._hint + self._hint // 4)
            )
        state.reserve(n, dim, len(self.tables))
        return state

    @property
    def open_total(self) -> int:
        """Open aggregations over every table and step."""
        return sum(int(s.cnt[2]) for s in self.pending.values()) if self.pending else 0

    def open_of(self, t: int) -> int:
        """Open aggregations of table position ``t``."""
        return sum(int(s.open_t[t]) for s in self.pending.values() if t < s.open_t.shape[0])

    def settle(self, step: int) -> None:
        """After an apply: ``step``'s state is retired once nothing of it is open."""
        state = self.pending.get(step)
        if state is not None and state.open == 0:
            self._retire(step)

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
                dropped, expected = state.abort(t, self.tables[t].arrays.row_marks)
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
