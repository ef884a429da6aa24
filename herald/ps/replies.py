"""The replies a shard keeps for its clients' retries, and its error replies."""

from __future__ import annotations

import collections
import sys
import traceback

from herald.errors import ConfigError, HeraldError, ProtocolError
from herald.ps import wire
from herald.ps.admin import AdminRefused
from herald.ps.checkpoint import CheckpointError
from herald.ps.wire import PS


# NOTE [reply cache]
# ~~~~~~~~~~~~~~~~~~
# A mutating request (wire.MUTATING) must not be applied twice when a client retries it
# (NOTE [ps client deadline] in herald/ps/link.py), so its whole reply is kept, keyed
# by (client id, request id), and a repeat is answered from it. A reply is needed only
# while its client may still retry the request: every request carries ``done_below``,
# the lowest request id its client still awaits a reply to (request ids grow per
# client), and the shard forgets that client's replies below it. So a shard keeps about
# one reply per client (a step message's: its rows and the dense sum, hundreds of KB)
# instead of the last ``reply_cache`` of all clients: kept for thousands of steps, those
# made every reply's memory fresh pages to fault in (page-clearing was 17% of a
# shard's CPU samples, perf, 2 workers), and held up to ``reply_cache`` x that size.
# A copy of a request below ``done_below`` that arrives later (a retry overtaken on
# another connection) is dropped unanswered: its client holds the reply or gave the
# request up. ``reply_cache`` still bounds the replies kept, and the clients whose
# ``done_below`` is remembered.
class ReplyCache:
    """The kept replies of mutating requests (NOTE [reply cache]), at most ``limit`` of
    them, and the ``done_below`` of at most ``limit`` clients."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._replies: collections.OrderedDict = collections.OrderedDict()
        self._rids: dict[int, collections.deque] = {}  # per client, its kept replies' request ids in order
        self._done_below: collections.OrderedDict = collections.OrderedDict()  # per client, its done_below

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, key: tuple[int, int]) -> list | None:
        """The kept reply frames of request ``key`` (client id, request id), or None."""
        return self._replies.get(key)

    def remember(self, key: tuple[int, int], reply: list) -> None:
        """Keep the reply of mutating request ``key`` (client id, request id) for its retries."""
        self._replies[key] = reply
        self._rids.setdefault(key[0], collections.deque()).append(key[1])
        if len(self._replies) > self.limit:
            (cid, rid), _ = self._replies.popitem(last=False)
            self._drop_rid(cid, rid)

    def answered(self, key: tuple[int, int], header: dict) -> bool:
        """Record the client's ``done_below`` (dropping its kept replies below it); True
        when request ``key`` itself is below it.

        Raises:
            ProtocolError: ``done_below`` is not an int in [0, 2**64).
        """
        cid, rid = key
        done = self._done_below.get(cid, 0)
        if "done_below" in header:
            done = max(done, wire.get_int(header, "done_below", 0, (1 << 64) - 1))
            self._done_below[cid] = done
            self._done_below.move_to_end(cid)
            if len(self._done_below) > self.limit:
                self._done_below.popitem(last=False)
        rids = self._rids.get(cid)
        while rids and rids[0] < done:
            self._replies.pop((cid, rids.popleft()), None)
        if rids is not None and not rids:
            del self._rids[cid]
        return rid < done

    def _drop_rid(self, cid: int, rid: int) -> None:
        """The oldest kept reply of all was evicted: it is also its client's oldest."""
        rids = self._rids.get(cid)
        if rids and rids[0] == rid:
            rids.popleft()
            if not rids:
                del self._rids[cid]


def error_kind(exc: BaseException) -> str:
    """The ``error`` of a reply to a request that failed with ``exc`` (the client raises by it)."""
    if isinstance(exc, CheckpointError):
        return "checkpoint"
    if isinstance(exc, AdminRefused):
        return "refused"
    if isinstance(exc, ConfigError):
        return "config"
    if isinstance(exc, ProtocolError):
        return "protocol"
    return "internal"


def error_reply(counters: collections.Counter, op: object, rid: int, exc: BaseException) -> list:
    """The error reply frames of request ``rid`` that failed with ``exc``, counted in
    ``counters`` (``errors``, ``errors_<kind>``); an internal error's traceback goes to stderr."""
    kind = error_kind(exc)
    counters["errors"] += 1
    counters["errors_" + kind] += 1
    if kind == "internal":
        traceback.print_exception(exc, file=sys.stderr)
    msg = str(exc) if isinstance(exc, HeraldError) else f"{type(exc).__name__}: {exc}"
    # echo only a known op: an arbitrary one could push the reply past the header limit
    return PS.pack({"op": op if op in wire.OPS else "", "rid": rid, "ok": False, "error": kind, "message": msg[:2000]})
