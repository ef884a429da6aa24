"""Who may speak to the dispatcher, and in which words: message validation and the
identity table of its workers.

No paper covers this (they assume trusted peers); it extends NOTE [wire format] in
herald/wire.py (nothing from a socket is unpickled) and the rule of no unbounded wait
to whatever arrives.

NOTE [peer validation] (docs/operations.md, "Hostile or malformed peers"): the
dispatcher's ROUTER port accepts a message from anyone who can reach it (a raw TCP
connection is delivered too: libzmq reads it as ZMTP/1.0 framing). Every received
message ``[identity, header, arrays...]`` is therefore checked, in this order:

1. ``undecodable``: it is not a valid NOTE [wire format] message of
   :data:`herald.wire.DISPATCH` (header size, msgpack, version, array descriptors,
   frame count and sizes).
2. ``unknown_op``: its ``op`` is not one a worker sends (``hello``, ``ack``,
   ``flushed``, ``saved``, ``error``: NOTE [dispatch protocol]).
3. ``bad_field``: a field the dispatcher reads has the wrong type or range (``rank``
   an int in ``[0, num_workers)``, ``world_size`` this dispatcher's, ``step``, the
   byte counts and ``ps_requests`` ints in ``[0, 2**63)``, ``loss`` a number,
   ``phases_ms`` a map, ``message`` a str), or its arrays are not those of its op (an
   ``ack`` carries none, or labels and predictions: two float32 ``[micro-batch size]``
   arrays; the others carry none). Fields the dispatcher does not read are ignored.
4. Identity binding: the first valid ``hello`` for a rank binds the ZeroMQ routing
   identity that sent it to that rank, for the whole job. A ``hello`` for a rank
   already bound, or from an identity already bound, is ``duplicate_hello`` (it never
   replaces the first binding). Any other op from an identity that never said hello
   is ``unknown_peer``; one whose ``rank`` is not the rank its identity is bound to is
   ``wrong_identity``.

A message failing a check is dropped and counted under its kind (:attr:`PeerTable.rejected`,
carried by every :class:`~herald.dispatch.records.StepRecord` and the job report's
``rejected``); the first of each kind is logged (logger ``herald.dispatch.peers``,
WARNING) with the sender's identity, escaped, and the reason; the rest are only
counted. Nothing is ever sent back to a rejected sender (no refusal message: an
answer would let a stranger make the dispatcher send, and a misconfigured worker
learns nothing it cannot read in the dispatcher's log). The dispatcher goes on
serving; the waits it is in keep their deadlines, so a flood of rejected messages
cannot keep it waiting past ``peer_timeout_ms``, and that timeout's message counts
what was dropped meanwhile.

Only a message that passes all four checks comes from a worker the job knows; such a
message that is out of place (an ``ack`` of a step not in flight, a second ``ack``,
``flushed`` that was not asked for) is that worker's bug and still stops the job with
a :class:`~herald.errors.ProtocolError`, and its ``error`` stops the job as before.
Binding is first-come: a stranger that says hello for a rank before the real worker
does takes the rank (the real worker's hello is then ``duplicate_hello`` and it times
out waiting for its config). Keeping strangers off the port altogether is the job of
transport security (ZeroMQ CURVE), not of this check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from herald import wire
from herald.contracts.modes import consistency_mode
from herald.errors import HeraldError, PeerTimeout

#: Kinds of rejected messages, in the order of NOTE [peer validation]'s checks.
KINDS = ("undecodable", "unknown_op", "bad_field", "unknown_peer", "wrong_identity", "duplicate_hello")

_LOG = logging.getLogger(__name__)
_MAX_COUNT = 1 << 63


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < _MAX_COUNT


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _str(v: Any) -> bool:
    return type(v) is str


def _map(v: Any) -> bool:
    return type(v) is dict


#: op -> {field: (required, check)}; ``rank`` is checked apart (its range needs num_workers).
_FIELDS: dict[str, dict[str, tuple[bool, Callable[[Any], bool]]]] = {
    "hello": {"world_size": (True, _count)},
    "ack": {
        "step": (True, _count),
        "loss": (False, _number),
        "bytes_pulled": (False, _count),
        "bytes_pushed": (False, _count),
        "bytes_allreduced": (False, _count),
        "bytes_dense": (False, _count),
        "phases_ms": (False, _map),
        "consistency": (False, _map),
        "ps_requests": (False, _count),
    },
    "flushed": {},
    "saved": {},
    "error": {"message": (False, _str)},
}


def largest_frame_bytes(job: Any, num_workers: int, batch_size_per_worker: int) -> int:
    """The largest array frame a worker of ``job`` sends its dispatcher, in bytes: the
    bound of the dispatcher's socket (NOTE [message size limits] in herald/wire.py;
    header frames are bounded apart, by :data:`herald.wire.DISPATCH`).

    Only an ``ack`` carries arrays (check 3 above): labels and predictions, float32
    [rows]; under a mode with a dispatcher-side embedding worker (hybrid:
    :attr:`PeerTable.ack_grads`) also sample ids, uint64 [rows], and bag gradients,
    float32 [rows, tables, dim]. ``rows`` is one micro-batch: ``batch_size_per_worker``,
    or under GBA the global batch (``num_workers * batch_size_per_worker``) over its
    M micro-batches (:meth:`~herald.contracts.consistency.ModeSettings.micro_batch_rows`). 0 rows
    (the batch size unknown): 0.

    Args:
        job: the :class:`~herald.contracts.job.JobSpec` served (tables, mode).
        num_workers: the ranks this dispatcher serves; batch_size_per_worker: ``--batch-size``.
    """
    rows = job.mode.micro_batch_rows(batch_size_per_worker, num_workers)
    if not consistency_mode(job.consistency).embedding_worker:
        return rows * 4
    return rows * max(8, 4 * len(job.tables) * job.dim)


class Silence(NamedTuple):
    """What a dispatcher's failed wait on its workers saw (NOTE [silent workers] in
    herald/job/recovery/silence.py): ``quiet`` every rank that had sent nothing for at least
    ``min_s`` seconds, rank -> seconds since its last message (an ``error`` does not
    count: a worker that reports a failure after a long wait was waiting too);
    ``awaited`` the ranks the wait was for; ``reported`` the ranks whose ``error`` came;
    ``waiting_for`` the wait, in words."""

    quiet: dict[int, float]
    awaited: frozenset[int]
    reported: frozenset[int]
    waiting_for: str
    min_s: float

    @property
    def silent(self) -> dict[int, float]:
        """The awaited ranks among :attr:`quiet`: those the failed wait waited on in vain."""
        return {r: s for r, s in self.quiet.items() if r in self.awaited}


class Message(NamedTuple):
    """A message that passed NOTE [peer validation]: from ``rank``'s bound identity."""

    identity: bytes
    rank: int
    header: dict[str, Any]
    arrays: list[np.ndarray]


def printable(identity: bytes, limit: int = 64) -> str:
    """``identity`` (a ZeroMQ routing id, up to 255 arbitrary bytes) as an escaped,
    printable Python bytes literal of at most ``limit`` bytes, e.g. ``b'worker-0'``."""
    text = repr(bytes(identity[:limit]))
    return text + ("..." if len(identity) > limit else "")


class PeerTable:
    """The identity table of one dispatcher's workers and its message checks
    (NOTE [peer validation]).

    Args:
        num_workers: ranks ``0..num_workers-1`` may be bound.
        name: names the dispatcher in log lines (its address).

    Attributes:
        identities: rank -> the routing identity bound to it (bytes).
        rejected: kind (:data:`KINDS`) -> messages dropped so far.
        ack_rows: samples per micro-batch once known (None before): the length of an
            ack's label and prediction arrays.
        ack_grads: ``(tables, dim)`` when acks also carry gradients by sample id (NOTE
            [hybrid training] in herald/dispatch/hybrid.py: two more arrays, uint64 [rows]
            and float32 [rows, tables, dim]), else None.
    """

    def __init__(self, num_workers: int, name: str = "dispatcher"):
        self.num_workers, self.name = num_workers, name
        self.identities: dict[int, bytes] = {}
        self._rank_of: dict[bytes, int] = {}
        self.rejected: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.ack_rows: int | None = None
        self.ack_grads: tuple[int, int] | None = None
        # NOTE [silent workers] (herald/job/recovery/silence.py): when each rank was last heard from
        # (made: the handshake's start), the ranks that reported an error, and the wait in
        # progress (ranks, words), kept when it fails
        self._made = time.monotonic()
        self._heard: dict[int, float] = {}
        self._reported: set[int] = set()
        self._wait: tuple[tuple[int, ...], str] | None = None

    @property
    def complete(self) -> bool:
        """Every rank is bound (the handshake is over)."""
        return len(self.identities) == self.num_workers

    def missing(self) -> list[int]:
        """Ranks no identity said hello for yet, ascending."""
        return [r for r in range(self.num_workers) if r not in self.identities]

    def summary(self) -> str:
        """``""`` when nothing was rejected, else e.g. ``"; 5 malformed or foreign messages
        were dropped meanwhile (undecodable 3, unknown_peer 2; see the log)"``."""
        total = sum(self.rejected.values())
        if not total:
            return ""
        kinds = ", ".join(f"{k} {n}" for k, n in self.rejected.items() if n)
        return f"; {total} malformed or foreign messages were dropped meanwhile ({kinds}; see the log)"

    def admit(self, frames: Sequence[Any]) -> Message | None:
        """Check one received ROUTER message (NOTE [peer validation]).

        Args:
            frames: ``[identity, header, array frames...]`` (``zmq.Frame`` or bytes) as
                ``recv_multipart`` returns them.

        Returns:
            The :class:`Message` (a valid ``hello`` binds its identity first), or None
            when it was rejected: counted in :attr:`rejected`, logged once per kind. Never raises.
        """
        identity = bytes(getattr(frames[0], "bytes", frames[0])) if frames else b""
        try:
            header, arrays = wire.DISPATCH.unpack(frames[1:])
        except Exception as exc:  # noqa: BLE001 - a trust boundary: nothing a peer sends may escape
            return self._reject("undecodable", identity, str(exc) or type(exc).__name__)
        op = header["op"]
        fields = _FIELDS.get(op)
        if fields is None:
            return self._reject("unknown_op", identity, f"op {op!r:.60}; a worker sends only {sorted(_FIELDS)}")
        problem = self._field_problem(op, fields, header, arrays)
        if problem:
            return self._reject("bad_field", identity, f"{op}: {problem}")
        rank = header["rank"]
        if op == "hello":
            return self._hello(identity, rank, header, arrays)
        bound = self._rank_of.get(identity)
        if bound is None:
            return self._reject(
                "unknown_peer", identity, f"{op} claiming rank {rank} from an identity that never said hello"
            )
        if bound != rank:
            return self._reject(
                "wrong_identity", identity, f"{op} claiming rank {rank} from the identity of rank {bound}"
            )
        return Message(identity, rank, header, arrays)

    def receive(
        self,
        sock: Any,
        deadline: float,
        *,
        waiting_for: str,
        timeout_ms: int,
        liveness: Callable[[], None] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> Message:
        """The next message on ``sock`` (the dispatcher's ROUTER) that passes :meth:`admit`;
        the others are dropped. Bounded: the deadline holds however many are dropped.

        Args:
            deadline: ``time.monotonic()`` seconds when to give up.
            waiting_for: what is awaited, e.g. ``"ack of step 3 from workers [1]"``.
            timeout_ms: the wait's length, shown in the timeout's message.
            liveness: called about every 0.5 s while waiting (even under a flood of
                dropped messages); raise from it to abort.
            ranks: the ranks awaited: a wait given them that fails is kept for
                :meth:`silence` (NOTE [silent workers]); None: not known, or a wait whose
                silence blames nobody (the handshake: workers still starting).

        Raises:
            PeerTimeout: nothing admitted by ``deadline`` (names ``waiting_for`` and what was dropped).
            HeraldError: a worker's ``error`` message (names its rank): the job stops.
        """
        if ranks is not None:
            self._wait = (tuple(ranks), waiting_for)
        next_check = time.monotonic() + 0.5
        while True:
            now = time.monotonic()
            if liveness is not None and now >= next_check:
                liveness()
                next_check = now + 0.5
            left_ms = int((deadline - now) * 1e3)
            if left_ms <= 0:
                raise PeerTimeout(
                    f"{self.name}: no message within {timeout_ms} ms while waiting for {waiting_for}; "
                    "check that those worker processes are alive (their log names the cause)" + self.summary(),
                    peer=waiting_for,
                    op="recv",
                )
            if not sock.poll(min(left_ms, 500)):
                continue
            msg = self.admit(sock.recv_multipart(copy=False))
            if msg is None:
                continue
            if msg.header["op"] == "error":
                self._reported.add(msg.rank)
                raise HeraldError(f"worker {msg.rank} failed: {msg.header.get('message')}")
            self._heard[msg.rank] = time.monotonic()
            if ranks is not None:
                self._wait = None  # this wait is over (a failed one is kept for silence())
            return msg

    def silence(self, min_s: float) -> Silence | None:
        """After a wait failed (:meth:`receive` raised, or its ``liveness`` did): the ranks
        that had sent nothing for at least ``min_s`` seconds, those awaited among them
        (NOTE [silent workers]); None when the last wait did not fail, named no ranks, or
        none of them was silent."""
        if self._wait is None:
            return None
        now = time.monotonic()
        ranks, waiting_for = self._wait
        quiet = {r: now - self._heard.get(r, self._made) for r in range(self.num_workers)}
        quiet = {r: s for r, s in quiet.items() if s >= min_s}
        if not any(r in quiet for r in ranks):
            return None
        return Silence(quiet, frozenset(ranks), frozenset(self._reported), waiting_for, min_s)

    # ------------------------------------------------------------------ checks
    def _field_problem(self, op: str, fields: dict, header: dict[str, Any], arrays: list[np.ndarray]) -> str:
        rank = header.get("rank")
        if type(rank) is not int or not 0 <= rank < self.num_workers:
            return f"rank {rank!r:.40} is not an int in [0, {self.num_workers})"
        for name, (required, ok) in fields.items():
            if name in header and not ok(header[name]) or required and name not in header:
                return f"field {name!r} missing or malformed ({header.get(name)!r:.40})"
        if op == "hello" and header["world_size"] != self.num_workers:
            return (
                f"worker {rank} expects world size {header['world_size']}, this dispatcher serves "
                f"{self.num_workers}; start every worker with --world-size {self.num_workers}"
            )
        if op == "ack" and self.ack_grads is not None:
            problem = self._grads_problem(arrays)
            if problem:
                return problem
            arrays = arrays[:-2]
        if op != "ack" or not arrays:
            return f"{len(arrays)} arrays where {op} carries none" if arrays else ""
        rows = self.ack_rows if self.ack_rows is not None else arrays[0].shape[0] if arrays[0].ndim else -1
        if len(arrays) != 2 or any(a.dtype != np.float32 or a.shape != (rows,) for a in arrays):
            return (
                f"an ack carries no arrays or two float32 [{self.ack_rows or 'micro-batch size'}] (labels, "
                f"predictions); got {[(a.dtype.str, a.shape) for a in arrays][:4]}"
            )
        return ""

    def _grads_problem(self, arrays: list[np.ndarray]) -> str:
        rows = self.ack_rows if self.ack_rows is not None else arrays[-2].shape[0] if len(arrays) >= 2 else -1
        want = [(np.uint64, (rows,)), (np.float32, (rows, *self.ack_grads))]
        if len(arrays) < 2 or any(a.dtype != d or a.shape != s for a, (d, s) in zip(arrays[-2:], want)):
            return (
                f"a hybrid ack ends with sample ids uint64 [{rows}] and gradients float32 [{rows}, "
                f"{self.ack_grads[0]}, {self.ack_grads[1]}]; got {[(a.dtype.str, a.shape) for a in arrays][-2:]}"
            )
        return ""

    def _hello(self, identity: bytes, rank: int, header: dict[str, Any], arrays: list) -> Message | None:
        if rank in self.identities or identity in self._rank_of:
            bound = self._rank_of.get(identity)
            return self._reject(
                "duplicate_hello",
                identity,
                f"hello for rank {rank}, "
                + (
                    f"an identity already bound to rank {bound}"
                    if bound is not None
                    else f"already bound to {printable(self.identities[rank])}"
                ),
            )
        self.identities[rank], self._rank_of[identity] = identity, rank
        return Message(identity, rank, header, arrays)

    def _reject(self, kind: str, identity: bytes, detail: str) -> None:
        self.rejected[kind] += 1
        if self.rejected[kind] == 1:
            _LOG.warning(
                "%s: dropped a message from peer %s (%s): %s; further %s messages are only counted "
                "(the job report's 'rejected'; docs/operations.md, \"Hostile or malformed peers\")",
                self.name,
                printable(identity),
                kind,
                detail[:300],
                kind,
            )
