"""Pending gradient aggregation of one table for one step.

NOTE [ps aggregation] (docs/design.md, "Consistency protocol"; NOTE [step protocol] in
herald/scheduler/plan.py, step 4). A ``push_grad`` carries, per key, the number of
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
- when a step has no open (key, step) left, its gradients are freed but its key map is
  kept for the last ``RETAIN_STEPS`` (4) such steps, so a late or repeated contribution
  to a completed (key, step) is still rejected; older completed steps are forgotten.
- ``contributors`` is at most the job's workers and ``rank`` below it (NOTE [ps limits]:
  ``max_contributors``, or the ``workers`` of a declare); a gradient holding a NaN or
  an infinity is refused whole (nothing stored).
- an aggregation still open ``aggregation_timeout_ms`` after its (table, step) opened
  (a rank died, or a caller declared a contributor that never pushes) is aborted: its
  rows are unmarked and its gradients dropped, the shard counts it
  (``stats()["counters"]["aggregations_aborted"]``), logs it and lists it in
  ``stats()["aborted"]`` with the ranks that did not push, and every later push to
  that (table, step) is rejected. Checkpoints are accepted again.
"""

from __future__ import annotations

import time

import numpy as np

from herald.errors import ProtocolError
from herald.ps import kernels as K

_CHECK_MESSAGES = {
    1: "contributors must be >= 1",
    2: "contributors differ from an earlier contribution to the same (key, step)",
    3: "(key, step) already received all its contributions",
    4: "this rank already contributed to (key, step)",
}


class PendingStep:
    """Open aggregations of one (table, step): arrays as in the kernels' layout."""

    def __init__(self, dim: int, capacity: int = 0):
        self.dim = dim
        cap = max(int(capacity), 0)
        hcap = 2
        while hcap < 2 * cap:
            hcap *= 2
        self.pk = np.zeros(hcap, np.uint64)
        self.pi = np.full(hcap, -1, np.int64)
        self.p_key = np.zeros(cap, np.uint64)
        self.p_slot = np.zeros(cap, np.int64)
        self.p_expected = np.zeros(cap, np.int32)
        self.p_arrived = np.zeros(cap, np.int32)
        self.p_head = np.zeros(cap, np.int64)
        self.e_rank = np.zeros(cap, np.int32)
        self.e_next = np.zeros(cap, np.int64)
        self.e_grad = np.zeros((cap, dim), np.float32)
        self.cnt = np.zeros(3, np.int64)
        #: ``time.monotonic()`` when the step last went from no open aggregation to some
        self.opened_at = time.monotonic()
        #: set when the open aggregations were aborted (NOTE [ps aggregation]): the report
        self.aborted: dict | None = None

    @property
    def open(self) -> int:
        return int(self.cnt[2])

    def abort(self, row_marks: np.ndarray) -> tuple[int, list[int]]:
        """Drop every open aggregation: unmark its row in ``row_marks`` (int32 [rows]).

        Returns (open keys dropped, the distinct ``contributors`` they expected).
        """
        n = int(self.cnt[0])
        open_idx = np.flatnonzero(self.p_arrived[:n] < self.p_expected[:n])
        np.subtract.at(row_marks, self.p_slot[open_idx], 1)
        self.p_arrived[open_idx] = self.p_expected[open_idx]   # nothing open is left
        self.cnt[2] = 0
        return int(open_idx.size), sorted(set(self.p_expected[open_idx].tolist()))

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more pending keys and entries."""
        need_p = int(self.cnt[0]) + n
        if need_p > self.p_key.shape[0]:
            cap = max(need_p, 2 * self.p_key.shape[0], 64)
            for name in ("p_key", "p_slot", "p_expected", "p_arrived", "p_head"):
                old = getattr(self, name)
                new = np.zeros(cap, old.dtype)
                new[: old.shape[0]] = old
                setattr(self, name, new)
        if 2 * need_p > self.pk.shape[0]:
            hcap = self.pk.shape[0]
            while hcap < 2 * need_p:
                hcap *= 2
            self.pk = np.zeros(hcap, np.uint64)
            self.pi = np.full(hcap, -1, np.int64)
            K.ht_rebuild_jit(self.pk, self.pi, self.p_key, int(self.cnt[0]))
        need_e = int(self.cnt[1]) + n
        if need_e > self.e_rank.shape[0]:
            cap = max(need_e, 2 * self.e_rank.shape[0], 64)
            for name in ("e_rank", "e_next"):
                old = getattr(self, name)
                new = np.zeros(cap, old.dtype)
                new[: old.shape[0]] = old
                setattr(self, name, new)
        if self.e_grad.shape[0] < self.e_rank.shape[0]:  # grown, or freed by a retired step
            g = np.zeros((self.e_rank.shape[0], self.dim), np.float32)
            g[: self.e_grad.shape[0]] = self.e_grad
            self.e_grad = g

    def check(self, keys: np.ndarray, contributors: np.ndarray, rank: int) -> None:
        """Raise :class:`ProtocolError` if the push breaks NOTE [ps aggregation]."""
        if self.aborted is not None:
            a = self.aborted
            raise ProtocolError(f"push_grad rejected: the aggregation of step {a['step']} on table "
                                f"{a['table']!r} was aborted after {a['waited_ms']} ms (ranks that did not "
                                f"push: {a['missing_ranks']}); restore the latest checkpoint and resume; "
                                "see NOTE [ps aggregation]")
        code, i = K.check_push_grad_jit(self.pk, self.pi, self.p_expected, self.p_arrived,
                                        self.p_head, self.e_rank, self.e_next, keys,
                                        contributors, np.int64(rank))
        if code:
            raise ProtocolError(f"push_grad rejected: {_CHECK_MESSAGES[int(code)]} "
                                f"(key {int(keys[i])}, rank {rank}); see NOTE [ps aggregation]")

    def push(self, rows, row_marks, slots, keys, grads, contributors, rank, kind, hp) -> int:
        """Record and apply (see :func:`herald.ps.kernels.push_grad_jit`); returns rows updated."""
        self.reserve(keys.shape[0])
        return int(K.push_grad_jit(rows, row_marks, slots, keys, grads, contributors, np.int64(rank),
                                   self.pk, self.pi, self.p_key, self.p_slot, self.p_expected,
                                   self.p_arrived, self.p_head, self.e_rank, self.e_next,
                                   self.e_grad, self.cnt, kind, self.dim, hp))
