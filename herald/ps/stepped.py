"""One request per worker per shard per step: NOTE [step messages].

The shard side: :class:`StepBarrier` (the messages held per step and rank) and
:class:`StepOps` (the ``step`` op, its release and expiry: its tick). The client side is
:class:`~herald.ps.front_step.StepFront` (``PSClient.step_async``).

NOTE [step messages]
~~~~~~~~~~~~~~~~~~~~
A BSP worker ends step t with one ``step`` request to every shard of the job, empty or
not. Its header holds ``step`` t, ``rank`` r, ``workers`` N and ``sections``: at most one
of each op, in the order ``push_rows``, ``push_grad``, ``pull``, ``dense``, each ``{"op": op,
"frames": k}`` (and ``"parts": m`` when m > 1), its k frames following in the message in
that order, each section but ``dense`` m flat parts (one, or one per table shape of a job
whose tables differ in width) exactly as the op's own request carries them (NOTE [ps wire
protocol]; NOTE [wire compression] by the header's ``wire``):

- ``push_rows``: the rows plan-pushed at step t (Herald Alg. 2) and the write-backs of the
  evictions of step t + 1 (the worker evicts for t + 1 once step t's local updates are done);
- ``push_grad``: the gradients of step t with their contributors (NOTE [ps aggregation]);
- ``pull``: every key the worker pulls at step t + 1 (none is fetched early);
- ``dense``: one frame, float32 [n], this shard's slice of the worker's dense gradient of
  step t (NOTE [dense gradients on the shards]).

The shard applies the writes as the message comes and holds the reply. When the step-t
messages of all N ranks have come, it reads the held pulls and answers every rank at
once: a ``pull`` reply (rows per key, or the compressed frames). That reads exactly what
the serial protocol reads (NOTE [step protocol] in herald/contracts/plan.py), because a
key lives on one shard and:

1. every write of step t to this shard's keys (gradient pushes, plan pushes) is in one of
   the N messages, so it is applied before any pull of t + 1 is read;
2. the other writes in them are write-backs of t + 1's evictions: a key that worker w
   writes back at t + 1 is pulled by no worker at t + 1 (w held its only latest copy, and
   Herald Alg. 2 would have plan-pushed it at t if another worker read it at t + 1: NOTE
   [early pulls] in herald/dispatch/early.py), so the pulls read the same before or after;
3. no write of step t + 1 is in any of them, and none comes before the replies: a worker
   sends anything more (its step t + 1 message, a flush's write-backs) only after its
   step-t reply from this shard, which leaves after all N messages were applied.

So the step needs one round trip per shard, and the worker's dense all-reduce no longer
orders the PS writes (it may overlap the round trip, or ride in the message: NOTE [dense
gradients on the shards]). A worker
whose next micro-batch has not come yet (or whose next message is a flush or the end)
sends its step message without pulls, waits for the reply, and pulls at t + 1 on its
own: the same order. A rank's pushes above ``max_keys_per_request`` go ahead of its step
message as plain requests on the same connection (a shard serves one connection's
requests in order, so they are applied before the message counts), and its pulls above
it after the reply.

Retries are safe: a repeated step request (same client id and request id) re-addresses
the held reply, or is answered from the reply cache once released. A message of step t
from a rank that already has one held for t (a restarted worker: another client id)
replaces it. A step whose N messages do not all come within the shard's
``aggregation_timeout_ms`` gets an error reply naming the ranks that did not send; a
``restore`` drops every held step (they belong to the rolled-back run).

NOTE [dense gradients on the shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Step 7 of NOTE [step protocol] (herald/contracts/plan.py) sums the ranks' dense gradients;
a BSP worker whose gradient is small (at most ``herald.ps.config.DENSE_MAX_BYTES``, on the CPU) sends it
in its step messages instead of all-reducing it (herald/worker/dense.py): shard s of S gets
the slice ``[s * P // S, (s + 1) * P // S)`` of the P values (:func:`dense_slices`), none
when that is empty. At release the shard adds the held slices in rank order (rank 0's,
plus rank 1's, ...) and appends the sum to every rank's reply as its last frame, the
header saying ``dense``: its length. Every rank thus receives the same bytes, so the dense
replicas stay bit-identical; with two ranks the sum is the all-reduce's own (float addition
commutes), with more it is one fixed order where gloo's ring adds in another (the
reference test's 1e-5 covers either). The step then has one synchronisation point instead
of two (the PS round trip and the all-reduce), and a 2-worker job on 2 cores spends no CPU
on gloo's TCP loop (measured: 0.57 ms of CPU per all-reduce of DLRM's 110 KB, per rank).
The messages of one step must agree: all with a slice of one length or none, else every
rank gets an error reply.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from herald.errors import ProtocolError
from herald.ps import compress, wire
from herald.ps.arrivals import Arrivals
from herald.ps.context import ShardContext
from herald.ps.handler import Handler, Op, Peer, Reply, Request
from herald.ps.ops_rows import RowOps
from herald.ps.wire import PS

#: The sections of a step message, in their order (NOTE [step messages]).
SECTIONS = ("push_rows", "push_grad", "pull", "dense")
#: Flat parts one section of a step message may carry (one per table shape: NOTE [step messages]).
MAX_SECTION_PARTS = 64
#: Steps held at once on a shard (a message of one more step is refused; a job holds
#: one, or two while a restarted worker's message replaces a lost one).
MAX_HELD_STEPS = 64


# --------------------------------------------------------------------- shard side
@dataclasses.dataclass
class _Held:
    """One rank's step message waiting for the others: where to answer and its pull."""

    peer: Peer
    key: tuple[int, int]  # (client id, request id): the reply cache's key
    pull: tuple[dict, list] | None  # the pull section's (header, arrays), read at release
    dense: np.ndarray | None = None  # float32 [n]: this shard's slice of the rank's dense gradient
    resolved: list | Exception | None = None  # the pull's parts and slots, found on arrival, or why not
    arrived: float = 0.0  # time.monotonic() when the shard took the message up (NOTE [step arrivals])


class StepBarrier:
    """The step messages a shard holds (NOTE [step messages]): per step, per rank.

    It also times the barrier (NOTE [step barrier timing]) and keeps the ranks' arrivals
    (:attr:`arrivals`, NOTE [step arrivals] in herald/ps/arrivals.py): :meth:`stats`."""

    def __init__(self) -> None:
        self.held: dict[int, dict[int, _Held]] = {}
        self._workers: dict[int, int] = {}
        self._opened: dict[int, float] = {}
        self._where: dict[tuple[int, int], tuple[int, int]] = {}  # request key -> (step, rank)
        self._released = 0
        self._spread_s, self._spread_max_s, self._release_s = 0.0, 0.0, 0.0
        self._last: dict[int, int] = {}  # rank -> steps whose message it sent last
        self.arrivals = Arrivals()

    # NOTE [step barrier timing]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A BSP worker's ``step_wait`` is the time from its step message to the reply; the
    # reply leaves once every rank's message of the step has come and the release (the
    # held pulls read, the replies packed) is done. So ``step_wait`` is the spread of
    # the ranks' arrivals (the wait for the slowest worker) plus the release plus the
    # transfers. Per released step the shard counts the spread (first to last message,
    # its own clock), which rank came last (a rank that is last far more often than 1/N
    # of the steps is a straggler: a shared core, a slower device) and how long the
    # release took; the report gives their means (herald/job/report/breakdown.py).
    def timed_release(self, last_rank: int, spread: float, release_s: float) -> None:
        """Count a released step: ``spread`` seconds from its first message to its last
        (``last_rank``'s, each timed once its writes were applied), then ``release_s``."""
        self._released += 1
        self._spread_s += spread
        self._spread_max_s = max(self._spread_max_s, spread)
        self._release_s += release_s
        self._last[last_rank] = self._last.get(last_rank, 0) + 1

    def stats(self) -> dict[str, Any]:
        """``released`` steps, ``spread_ms_mean`` / ``spread_ms_max`` (first to last message
        of a step), ``release_ms_mean``, ``last_rank`` ({rank: steps it came last}; str
        keys, msgpack maps); NOTE [step barrier timing]; ``arrivals``:
        :meth:`herald.ps.arrivals.Arrivals.summary`."""
        n = max(1, self._released)
        return {
            "released": self._released,
            "spread_ms_mean": round(1e3 * self._spread_s / n, 4),
            "spread_ms_max": round(1e3 * self._spread_max_s, 4),
            "release_ms_mean": round(1e3 * self._release_s / n, 4),
            "last_rank": {str(r): c for r, c in sorted(self._last.items())},
            "arrivals": self.arrivals.summary(),  # NOTE [step arrivals] in herald/ps/arrivals.py
        }

    def opened_at(self, step: int) -> float:
        """``time.monotonic()`` when the first message of held step ``step`` came."""
        return self._opened[step]

    def readdress(self, key: tuple[int, int], peer: Peer) -> bool:
        """A retried request still held: answer it at ``peer`` from now on; False if not held."""
        at = self._where.get(key)
        if at is None:
            return False
        self.held[at[0]][at[1]].peer = peer
        return True

    def add(self, step: int, rank: int, workers: int, held: _Held) -> bool:
        """Hold ``held``; True when step ``step`` now has all ``workers`` ranks' messages.

        Raises:
            ProtocolError: ``workers`` differs from what the step's first message said.
        """
        if step not in self.held:
            if len(self.held) >= MAX_HELD_STEPS:
                raise ProtocolError(
                    f"step {step}: this shard already holds {MAX_HELD_STEPS} unfinished steps; "
                    "are two jobs sharing the shards?"
                )
            self.held[step], self._workers[step], self._opened[step] = {}, workers, time.monotonic()
        elif self._workers[step] != workers:
            raise ProtocolError(
                f"step {step}: rank {rank} says {workers} workers, an earlier message said {self._workers[step]}"
            )
        old = self.held[step].get(rank)
        if old is not None:  # a restarted rank: its message replaces the lost one's
            self._where.pop(old.key, None)
        self.held[step][rank] = held
        self._where[held.key] = (step, rank)
        return len(self.held[step]) == workers

    def release(self, step: int) -> list[_Held]:
        """Forget step ``step``; its held messages in rank order."""
        ranks = self.held.pop(step, {})
        self._workers.pop(step, None)
        self._opened.pop(step, None)
        for h in ranks.values():
            self._where.pop(h.key, None)
        return [ranks[r] for r in sorted(ranks)]

    def expired(self, now: float, timeout_s: float) -> list[tuple[int, list[int], list[_Held]]]:
        """``(step, missing ranks, held)`` of each step open longer than ``timeout_s``, released."""
        out = []
        for step in [s for s, t0 in self._opened.items() if now - t0 > timeout_s]:
            workers = self._workers[step]
            missing = [r for r in range(workers) if r not in self.held[step]]
            out.append((step, missing, self.release(step)))
        return out

    def clear(self) -> list[_Held]:
        """Forget every held step (``restore``); what was held."""
        self.arrivals.forget()
        return [h for step in list(self.held) for h in self.release(step)]


def _sections(header: dict[str, Any], arrays: list) -> dict[str, tuple[list, int]]:
    """``{op: (frames, parts)}`` of a step message's ``sections`` (NOTE [step messages]).

    Raises:
        ProtocolError: a bad section list or frame count.
    """
    sections = header.get("sections")
    if type(sections) is not list or len(sections) > len(SECTIONS):
        raise ProtocolError(f"step: header 'sections' must be a list of at most {len(SECTIONS)} maps")
    out, at, last = {}, 0, -1
    for k, sec in enumerate(sections):
        op = sec.get("op") if type(sec) is dict else None
        frames = sec.get("frames") if type(sec) is dict else None
        parts = sec.get("parts", 1) if type(sec) is dict else None
        if (
            op not in SECTIONS
            or SECTIONS.index(op) <= last
            or type(parts) is not int
            or not 0 < parts <= (1 if op == "dense" else MAX_SECTION_PARTS)
            or type(frames) is not int
            or not 0 < frames <= 8 * parts
            or (len(sec) != (2 if "parts" not in sec else 3))
        ):
            raise ProtocolError(
                f"step: section {k} must be {{'op': one of {list(SECTIONS)} in that order, "
                f"'frames': 1..8 per part, 'parts': 1..{MAX_SECTION_PARTS} (1 by default)}}, got {sec!r:.80}"
            )
        last = SECTIONS.index(op)
        out[op] = (arrays[at : at + frames], parts)
        at += frames
    if at != len(arrays):
        raise ProtocolError(f"step: the sections name {at} frames, the message has {len(arrays)}")
    return out


def _dense_section(frames: list) -> np.ndarray:
    """The dense slice of a step message (NOTE [dense gradients on the shards]).

    Raises:
        ProtocolError: not one float32 1-d frame.
    """
    if len(frames) != 1 or frames[0].dtype != np.float32 or frames[0].ndim != 1:
        raise ProtocolError("step: the dense section must be one float32 1-d frame")
    return frames[0]


def _dense_sum(held: list[_Held]) -> np.ndarray | None:
    """The rank-order sum of the held dense slices (float32 [n]), or None when none has one.

    Raises:
        ProtocolError: some ranks sent a slice and others not, or slices of different lengths.
    """
    slices = [h.dense for h in held if h.dense is not None]
    if not slices:
        return None
    sizes = {None if h.dense is None else h.dense.shape[0] for h in held}
    if len(sizes) > 1:
        raise ProtocolError(
            f"step: the ranks' dense slices differ (lengths {sorted(sizes, key=str)}): every "
            "worker must train the same dense model the same way"
        )
    total = slices[0].copy()
    for dense in slices[1:]:
        total += dense
    return total


def dense_slices(size: int, shards: int) -> list[slice]:
    """The slice of a dense gradient of ``size`` values each of ``shards`` shards sums (NOTE
    [dense gradients on the shards])."""
    return [slice(s * size // shards, (s + 1) * size // shards) for s in range(shards)]


class StepOps(Handler):
    """The ``step`` op of one shard (NOTE [step messages]): a message's writes applied by
    the row ops as it comes, its reply held in :attr:`barrier` until every rank's message
    of its step came, then every rank answered at once.

    Args:
        ctx: the shard's :class:`~herald.ps.context.ShardContext`.
        rows: the row ops that apply the sections (their public methods).
    """

    def __init__(self, ctx: ShardContext, rows: RowOps):
        self.ctx, self.rows = ctx, rows
        self.barrier = StepBarrier()

    def ops(self) -> dict[str, Op]:
        return {"step": self.step}

    def readdress(self, key: tuple[int, int], peer: Peer) -> bool:
        """A held retry (:meth:`Handler.readdress`): the barrier's."""
        return self.barrier.readdress(key, peer)

    def stats(self) -> dict[str, Any]:
        """The barrier's timing (NOTE [step barrier timing])."""
        return self.barrier.stats()

    def restored(self) -> None:
        """Forget every held step (a ``restore``: they belong to the rolled-back run)."""
        self.barrier.clear()

    def step(self, request: Request) -> list[Reply]:
        """A step message: apply its writes, hold it; the replies of every held message of
        its step once all its ranks' came (each kept for retries), else none.

        Raises:
            ProtocolError: bad sections, a rank at or above ``workers``, a refused write (the
                sections applied before it stay applied).
        """
        arrived = time.monotonic()  # NOTE [step arrivals] in herald/ps/arrivals.py
        ctx, header = self.ctx, request.header
        step = wire.get_int(header, "step", -(1 << 62), 1 << 62)
        rank = wire.get_int(header, "rank", 0, 1 << 30)
        workers = wire.get_int(header, "workers", 1, ctx.job.contributor_bound)
        if rank >= workers:
            raise ProtocolError(f"step: rank {rank} is not below workers={workers}")
        sections = _sections(header, request.arrays)
        subs = {}
        for op, (_, parts) in sections.items():  # each section's parts, as the op's own request names them
            subs[op] = {"step": step, "rank": rank, "parts": [{"flat": True}] * parts}
            if "wire" in header:
                subs[op]["wire"] = compress.wire_of(header)
        if "push_rows" in sections:
            self.rows.push_rows(subs["push_rows"], sections["push_rows"][0])
        if "push_grad" in sections:
            self.rows.push_grad(subs["push_grad"], sections["push_grad"][0])
        ctx.counters["step_messages"] += 1
        pull = (subs["pull"], sections["pull"][0]) if "pull" in sections else None
        dense = _dense_section(sections["dense"][0]) if "dense" in sections else None
        if request.key is None:  # the loop keys every mutating request (NOTE [reply cache])
            raise ProtocolError("step: a step message needs its client and request ids (cid, rid)")
        held = _Held(request.peer, request.key, pull, dense, arrived=arrived)
        if pull is not None and not ctx.store.directory.bounded:  # NOTE [pulls resolved on arrival]
            try:
                held.resolved = self.rows.resolve_pull(*pull)
            except ProtocolError as exc:  # this rank's pull is refused at release; its writes stand
                held.resolved = exc
        if not self.barrier.add(step, rank, workers, held):
            return []
        return self._release(step, rank)

    def _release(self, step: int, rank: int) -> list[Reply]:
        """Every held message of ``step`` answered (``rank``'s came last)."""
        self.ctx.counters["steps_released"] += 1
        t0, opened = time.monotonic(), self.barrier.opened_at(step)
        held = self.barrier.release(step)
        try:
            total = _dense_sum(held)
        except ProtocolError as exc:  # the ranks disagree: none of them gets a sum
            return [Reply(h.peer, self.ctx.error_reply("step", h.key[1], exc)) for h in held]
        out = [Reply(h.peer, self._reply(h, total), h.key) for h in held]
        done = time.monotonic()
        self.barrier.timed_release(rank, t0 - opened, done - t0)  # NOTE [step barrier timing]
        self.barrier.arrivals.record(step, [h.arrived for h in held], done)  # NOTE [step arrivals]
        return out

    def _reply(self, held: _Held, dense: np.ndarray | None) -> list:
        """The reply frames of one released step message: its pull's rows (and the dense sum,
        last), or an error reply."""
        rid = held.key[1]
        try:
            head, rows = self._read_held_pull(held, held.pull) if held.pull is not None else ({}, [])
        except Exception as exc:  # this rank's pull is refused; the others are answered
            return self.ctx.error_reply("step", rid, exc)
        if dense is not None:
            head, rows = dict(head, dense=int(dense.shape[0])), [*rows, dense]
        return PS.pack(dict(head, op="step", rid=rid, ok=True), rows)

    # NOTE [pulls resolved on arrival]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The release is on every rank's critical path: the last message's writes, then every
    # held pull, then the replies. A pull is a hash lookup per key (inserting unseen keys)
    # and a row copy; only the copy must wait for the step's writes, because a row's slot
    # does not change while the rows change (growth copies the rows to the same slots). So
    # the shard resolves a step message's pull (checks it, finds its slots) when the message
    # comes and copies the rows at the release: on 2 cores with 2 workers the release fell
    # from 0.62 to 0.17-0.19 ms (NOTE [step barrier timing]). Not with an LRU-bounded
    # table (NOTE [bounded ps]): its eviction moves rows, so there a pull is resolved at the
    # release too. A pull refused on arrival fails that rank's reply at the release, as a
    # pull refused at the release does.
    def _read_held_pull(self, held: _Held, pull: tuple[dict, list]) -> tuple[dict, list]:
        """The reply to ``pull``, the pull section of a released message ``held``: resolved on
        arrival or now (NOTE [pulls resolved on arrival])."""
        if isinstance(held.resolved, Exception):
            raise held.resolved
        resolved = held.resolved if held.resolved is not None else self.rows.resolve_pull(*pull)
        return self.rows.read_pull(resolved, compress.wire_of(pull[0]))

    def tick(self, now: float) -> list[Reply]:
        """The loop's tick: error replies for the steps held longer than ``aggregation_timeout_ms``,
        naming the ranks whose step message did not come (also on stderr: the shard's log)."""
        ctx = self.ctx
        out = []
        timeout_ms = ctx.limits.aggregation_timeout_ms
        for step, missing, held in self.barrier.expired(now, timeout_ms / 1000.0):
            ctx.counters["steps_aborted"] += 1
            msg = (
                f"step {step}: ranks {missing} sent no step message within aggregation_timeout_ms={timeout_ms} "
                "(stopped, slow or lost workers: their logs name the cause)"
            )
            ctx.log(msg)
            out += [Reply(h.peer, ctx.error_reply("step", h.key[1], ProtocolError(msg))) for h in held]
        return out
