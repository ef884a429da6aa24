"""One request per worker per shard per step: NOTE [step messages].

The shard side (:class:`StepBarrier`, :func:`op_step`) and the client side
(:class:`StepOps`, mixed into :class:`~herald.ps.client.PSClient`).

NOTE [step messages]
~~~~~~~~~~~~~~~~~~~~
A BSP worker ends step t with one ``step`` request to every shard of the job, empty or
not. Its header holds ``step`` t, ``rank`` r, ``workers`` N and ``sections``: at most one
of each op, in the order ``push_rows``, ``push_grad``, ``pull``, ``dense``, each ``{"op": op,
"frames": k}``, its k frames following in the message in that order, each section but
``dense`` one flat part exactly as the op's own request carries it (NOTE [ps wire
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
the serial protocol reads (NOTE [step protocol] in herald/scheduler/plan.py), because a
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
Step 7 of NOTE [step protocol] (herald/scheduler/plan.py) sums the ranks' dense gradients;
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
import sys
import time
from typing import Any

import numpy as np

from herald.errors import ProtocolError
from herald.ps import compress, wire
from herald.ps.wire import PS

#: The sections of a step message, in their order (NOTE [step messages]).
SECTIONS = ("push_rows", "push_grad", "pull", "dense")
#: Steps held at once on a shard (a message of one more step is refused; a job holds
#: one, or two while a restarted worker's message replaces a lost one).
MAX_HELD_STEPS = 64


# --------------------------------------------------------------------- shard side
@dataclasses.dataclass
class _Held:
    """One rank's step message waiting for the others: where to answer and its pull."""

    peer: Any
    key: tuple[int, int]  # (client id, request id): the reply cache's key
    pull: tuple[dict, list] | None  # the pull section's (header, arrays), read at release
    dense: np.ndarray | None = None  # float32 [n]: this shard's slice of the rank's dense gradient
    resolved: list | Exception | None = None  # the pull's parts and slots, found on arrival, or why not


class StepBarrier:
    """The step messages a shard holds (NOTE [step messages]): per step, per rank.

    It also times the barrier (NOTE [step barrier timing]): :meth:`stats`."""

    def __init__(self):
        self.held: dict[int, dict[int, _Held]] = {}
        self._workers: dict[int, int] = {}
        self._opened: dict[int, float] = {}
        self._where: dict[tuple[int, int], tuple[int, int]] = {}  # request key -> (step, rank)
        self._released = 0
        self._spread_s, self._spread_max_s, self._release_s = 0.0, 0.0, 0.0
        self._last: dict[int, int] = {}  # rank -> steps whose message it sent last

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
        of a step), ``release_ms_mean`` and ``last_rank`` ({rank: steps it came last}; str
        keys, msgpack maps); NOTE [step barrier timing]."""
        n = max(1, self._released)
        return {
            "released": self._released,
            "spread_ms_mean": round(1e3 * self._spread_s / n, 4),
            "spread_ms_max": round(1e3 * self._spread_max_s, 4),
            "release_ms_mean": round(1e3 * self._release_s / n, 4),
            "last_rank": {str(r): c for r, c in sorted(self._last.items())},
        }

    def opened_at(self, step: int) -> float:
        """``time.monotonic()`` when the first message of held step ``step`` came."""
        return self._opened[step]

    def readdress(self, key: tuple[int, int], peer: Any) -> bool:
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
        return [h for step in list(self.held) for h in self.release(step)]


def _sections(header: dict[str, Any], arrays: list) -> dict[str, list]:
    """``{op: frames}`` of a step message's ``sections`` (NOTE [step messages]).

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
        if op not in SECTIONS or SECTIONS.index(op) <= last or type(frames) is not int or not 0 < frames <= 8:
            raise ProtocolError(
                f"step: section {k} must be {{'op': one of {list(SECTIONS)} in that order, "
                f"'frames': 1..8}}, got {sec!r:.80}"
            )
        last = SECTIONS.index(op)
        out[op] = arrays[at : at + frames]
        at += frames
    if at != len(arrays):
        raise ProtocolError(f"step: the sections name {at} frames, the message has {len(arrays)}")
    return out


def op_step(server, peer: Any, key: tuple[int, int], header: dict[str, Any], arrays: list) -> list[tuple[Any, list]]:
    """A step message on ``server`` (a ShardServer): apply its writes, hold it; the replies
    ``[(peer, frames)]`` of every held message of its step once all its ranks' came, else []."""
    step = wire.get_int(header, "step", -(1 << 62), 1 << 62)
    bound = server.contributor_bound
    rank = wire.get_int(header, "rank", 0, 1 << 30)
    workers = wire.get_int(header, "workers", 1, bound)
    if rank >= workers:
        raise ProtocolError(f"step: rank {rank} is not below workers={workers}")
    sections = _sections(header, arrays)
    sub = {"step": step, "rank": rank, "parts": [{"flat": True}]}
    if "wire" in header:
        sub["wire"] = compress.wire_of(header)
    if "push_rows" in sections:
        server._op_push_rows(sub, sections["push_rows"])
    if "push_grad" in sections:
        server._op_push_grad(sub, sections["push_grad"])
    server.counters["step_messages"] += 1
    pull = (sub, sections["pull"]) if "pull" in sections else None
    dense = _dense_section(sections["dense"]) if "dense" in sections else None
    held = _Held(peer, key, pull, dense)
    if pull is not None and not server.store.bounded:  # NOTE [pulls resolved on arrival]
        try:
            held.resolved = server.resolve_pull(*pull)
        except ProtocolError as exc:  # this rank's pull is refused at release; its writes stand
            held.resolved = exc
    if not server.steps.add(step, rank, workers, held):
        return []
    server.counters["steps_released"] += 1
    t0, opened = time.monotonic(), server.steps.opened_at(step)
    held = server.steps.release(step)
    try:
        total = _dense_sum(held)
    except ProtocolError as exc:  # the ranks disagree: none of them gets a sum
        return [(h.peer, server.error_reply("step", h.key[1], exc)) for h in held]
    out = []
    for h in held:
        frames = _reply(server, h, total)
        server.remember(h.key, frames)
        out.append((h.peer, frames))
    server.steps.timed_release(rank, t0 - opened, time.monotonic() - t0)  # NOTE [step barrier timing]
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
    sizes = {None if h.dense is None else h.dense.shape[0] for h in held}
    if sizes == {None}:
        return None
    if len(sizes) > 1:
        raise ProtocolError(
            f"step: the ranks' dense slices differ (lengths {sorted(sizes, key=str)}): every "
            "worker must train the same dense model the same way"
        )
    total = held[0].dense.copy()
    for h in held[1:]:
        total += h.dense
    return total


def _reply(server, held: _Held, dense: np.ndarray | None) -> list:
    """The reply frames of one released step message: its pull's rows (and the dense sum, last),
    or an error reply."""
    rid = held.key[1]
    try:
        head, rows = _read_held_pull(server, held) if held.pull is not None else ({}, [])
    except Exception as exc:  # this rank's pull is refused; the others are answered
        return server.error_reply("step", rid, exc)
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
def _read_held_pull(server, held: _Held) -> tuple[dict, list]:
    """The pull reply of a released message: resolved on arrival or now (NOTE [pulls resolved on arrival])."""
    if isinstance(held.resolved, Exception):
        raise held.resolved
    resolved = held.resolved if held.resolved is not None else server.resolve_pull(*held.pull)
    return server.read_pull(resolved, compress.wire_of(held.pull[0]))


def dense_slices(size: int, shards: int) -> list[slice]:
    """The slice of a dense gradient of ``size`` values each of ``shards`` shards sums (NOTE
    [dense gradients on the shards])."""
    return [slice(s * size // shards, (s + 1) * size // shards) for s in range(shards)]


def expire_steps(server, now: float) -> list[tuple[Any, list]]:
    """Error replies for the steps held longer than ``aggregation_timeout_ms``, naming the
    ranks whose step message did not come (also on stderr: the shard's log)."""
    out = []
    timeout_ms = server.limits.aggregation_timeout_ms
    for step, missing, held in server.steps.expired(now, timeout_ms / 1000.0):
        server.counters["steps_aborted"] += 1
        msg = (
            f"step {step}: ranks {missing} sent no step message within aggregation_timeout_ms={timeout_ms} "
            "(stopped, slow or lost workers: their logs name the cause)"
        )
        print(f"herald ps shard {server.shard}/{server.num_shards}: {msg}", file=sys.stderr, flush=True)
        out += [(h.peer, server.error_reply("step", h.key[1], ProtocolError(msg))) for h in held]
    return out


# --------------------------------------------------------------------- client side
class StepOps:
    """The step message of :class:`~herald.ps.client.PSClient` (NOTE [step messages]); it
    provides ``_flat_keys``, ``_shape``, ``_route``, ``_send``, ``_send_flat``, ``_take``,
    ``_wire``, ``_pull_op``, ``_rows_frames``, ``_grad_frames``, ``_handle``,
    ``num_shards`` and ``wire_dtype``."""

    def step_async(self, step: int, rank: int, workers: int, *, rows=None, grads=None, pull=None, dense=None):
        """Send worker ``rank``'s (of ``workers``) step message for ``step`` to every shard.

        Args:
            rows: ``(tables, keys, rows)`` or None: rows to store (float32 [n, row_width]:
                plan pushes of ``step``, write-backs of the evictions of ``step + 1``); keys unique.
            grads: ``(tables, keys, grads, contributors)`` or None: the gradients of ``step``
                (float32 [n, dim], uint16 [n]; NOTE [ps aggregation]); keys unique.
            pull: ``(tables, keys)`` or None: the pulls of ``step + 1``.
            dense: float32 [P] contiguous and writable, or None: this rank's dense gradient of
                ``step``, summed over the ranks by the shards (NOTE [dense gradients on the
                shards]); every rank of the step must send one of the same P, or none.

        Returns:
            A handle; ``wait()`` gives the pulled rows, float32 [len(pull keys), row_width] in
            key order (read-only when one shard held them all), once every shard has the step
            messages of all ``workers`` ranks (NOTE [step messages]); by then ``dense`` holds the
            sum over the ranks. Do not change the arrays before it returns.

        Raises:
            ConfigError: bad arrays (as the ops' own forms).
        """
        sections = []  # (op, tables, keys, frames_of(positions))
        if rows is not None and len(rows[1]):
            tables, keys = self._flat_keys(rows[0], rows[1])
            sections.append(("push_rows", tables, keys, self._rows_frames(tables, keys, rows[2])))
        if grads is not None and len(grads[1]):
            tables, keys = self._flat_keys(grads[0], grads[1])
            sections.append(("push_grad", tables, keys, self._grad_frames(tables, keys, grads[2], grads[3])))
        if pull is not None and len(pull[1]):
            tables, keys = self._flat_keys(pull[0], pull[1])
            sections.append(("pull", tables, keys, lambda pos: []))
        rids, pre, per_shard, late = [], [], [[] for _ in range(self.num_shards)], []
        for op, tables, keys, frames_of in sections:
            seen = set()
            for sh, pos in self._route(tables, keys):
                if sh not in seen:
                    seen.add(sh)
                    per_shard[sh].append((op, [*self._take((tables, keys), pos), *frames_of(pos)], pos))
                elif op == "pull":
                    late.append((tables, keys, pos))
                else:  # over max_keys_per_request: ahead of the step message, on the same connection
                    pre.append(
                        self._send_flat(
                            op, {"step": int(step), "rank": int(rank)}, [(sh, pos)], tables, keys, frames_of
                        )[0]
                    )
        slices = [] if dense is None else dense_slices(dense.shape[0], self.num_shards)
        for sh, part in enumerate(slices):
            if part.stop > part.start:
                per_shard[sh].append(("dense", [dense[part]], None))
        for sh in range(self.num_shards):
            header = self._wire(
                {
                    "step": int(step),
                    "rank": int(rank),
                    "workers": int(workers),
                    "sections": [{"op": op, "frames": len(fr)} for op, fr, _ in per_shard[sh]],
                }
            )
            rids.append(self._send(sh, "step", header, [f for _, fr, _ in per_shard[sh] for f in fr]))
        pulled = next((s for s in sections if s[0] == "pull"), None)

        def finish(replies):
            replies = replies[len(pre) :]
            for part, (head, arrays) in zip(slices, replies):  # the sum over the ranks: last frame
                if part.stop > part.start:
                    dense[part] = self._dense_of(head, arrays, part.stop - part.start)
            if pulled is None:
                return None
            _, tables, keys, _ = pulled
            width = self._shape(tables)[1]
            parts = [
                (pos, compress.decode_rows(arrays[:-1] if "dense" in head else arrays, compress.wire_of(head))[0])
                for (head, arrays), sh_sections in zip(replies, per_shard)
                for op, _, pos in sh_sections
                if op == "pull"
            ]
            if len(parts) == 1 and parts[0][0] is None and not late:  # one shard held every key: zero copy
                return parts[0][1]
            out = np.empty((keys.shape[0], width), np.float32)
            for pos, got in parts:
                wire.put_rows(out, pos, got, "step reply")
            for t, k, pos in late:  # after the reply: ordered after the step (NOTE [step messages])
                wire.put_rows(out, pos, self._handle(*self._pull_op(t[pos], k[pos])).wait(), "pull reply")
            return out

        return self._handle(pre + rids, finish)

    @staticmethod
    def _dense_of(head: dict, arrays: list, size: int) -> np.ndarray:
        """The dense sum a step reply ends with (NOTE [dense gradients on the shards]).

        Raises:
            ProtocolError: the reply has none, or one of another length.
        """
        if head.get("dense") != size or not arrays or arrays[-1].shape != (size,):
            raise ProtocolError(
                f"step: the reply should end with the dense sum of {size} values; it says {head.get('dense')!r}"
            )
        return arrays[-1]
