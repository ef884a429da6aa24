"""The interface between a shard's request loop and its op handlers.

The loop (herald/ps/loop.py) decodes a request into a :class:`Request` and calls the op
registered for its ``op``; every op answers with the replies now due, a list of
:class:`Reply`: the request's own (an op answered at once, :meth:`Request.answer`), none
(a request held, as a step message until every rank's has come: NOTE [step messages] in
herald/ps/stepped.py), or several (every held request of a step, released by the last
one). A reply that names a request ``key`` is kept for that request's retries (NOTE
[reply cache] in herald/ps/replies.py). A handler groups the ops of one responsibility
(:meth:`Handler.ops`); :func:`registry` maps every op of NOTE [ps wire protocol] to its
handler once, so the loop special-cases no op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

from herald.errors import HeraldError
from herald.ps import wire
from herald.ps.wire import PS

#: The ROUTER routing id of the client a request came from (None: a request handled in
#: process, :meth:`herald.ps.server.ShardServer.handle`).
Peer = bytes | None


class Reply(NamedTuple):
    """A reply due: the routing id of the ``peer`` to send it to, its ``frames`` (header +
    arrays), and the ``key`` (client id, request id) of the request it answers when it is
    to be kept for retries (a mutating request's; None: not kept)."""

    peer: Peer
    frames: list
    key: tuple[int, int] | None = None


@dataclasses.dataclass(slots=True)
class Request:
    """One decoded request: from ``peer`` (its routing id), its ``op`` and request id ``rid``
    (-1 when the header has none), ``key`` (client id, request id) of a mutating request
    (None otherwise), its ``header`` and its ``arrays`` (read-only views of the frames)."""

    peer: Peer
    op: str
    rid: int
    key: tuple[int, int] | None
    header: dict
    arrays: list

    def answer(self, header: dict, arrays: Sequence = ()) -> list[Reply]:
        """This request's reply now: ``header`` (completed with ``op``, ``rid``, ``ok``) and
        ``arrays``; kept for retries when the request mutates."""
        header.update(op=self.op, rid=self.rid, ok=True)
        return [Reply(self.peer, PS.pack(header, arrays), self.key)]


#: An op: the replies due once ``request`` came.
Op = Callable[[Request], list[Reply]]


class Handler:
    """The ops of one responsibility of a shard (subclasses: herald/ps/ops_*.py,
    herald/ps/stepped.py, herald/ps/gba.py; each consistency mode's are named in
    herald/ps/modes.py)."""

    def ops(self) -> dict[str, Op]:
        """``{op name: op}`` this handler serves."""
        raise NotImplementedError

    def tick(self, now: float) -> list[Reply]:
        """The replies due by time at ``now`` (``time.monotonic()`` seconds: expiries), called
        by the loop every :data:`herald.ps.loop.EXPIRE_EVERY_S`; the default: none."""
        return []

    def restored(self) -> None:
        """A ``restore`` rolled the shard back: drop what this handler holds of the rolled-back
        run (held step messages, GBA's buffer); the default: nothing held."""

    def readdress(self, key: tuple[int, int], peer: Peer) -> bool:
        """A retry of request ``key`` came from ``peer``: True if this handler holds the
        request (its reply then goes to ``peer``), False otherwise (the default: nothing held)."""
        return False


def answering(method: Callable[[dict, list], tuple[dict, Sequence]]) -> Op:
    """An op answered at once by ``method(header, arrays) -> (reply header, reply arrays)``."""

    def op(request: Request) -> list[Reply]:
        return request.answer(*method(request.header, request.arrays))

    return op


def registry(handlers: Sequence[Handler]) -> dict[str, tuple[Handler, Op]]:
    """``{op: (handler, op)}`` over ``handlers``, every op of :data:`herald.ps.wire.OPS` once.

    Raises:
        HeraldError: an op served twice, one not served, or one unknown to the wire protocol.
    """
    out: dict[str, tuple[Handler, Op]] = {}
    for handler in handlers:
        for name, op in handler.ops().items():
            if name in out:
                raise HeraldError(
                    f"op {name!r} has two handlers: {type(out[name][0]).__name__}, {type(handler).__name__}"
                )
            out[name] = (handler, op)
    if set(out) != set(wire.OPS):
        raise HeraldError(
            f"the shard's handlers serve {sorted(out)}, the wire protocol has {sorted(wire.OPS)}: "
            "register a handler for every op"
        )
    return out
