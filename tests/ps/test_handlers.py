"""The shard's op registry and handler interface (herald/ps/handler.py)."""

import pytest

from herald.errors import HeraldError
from herald.ps import wire
from herald.ps.handler import Handler, Reply, Request, answering, registry
from herald.ps.server import ShardServer
from herald.ps.wire import PS


class _Ops(Handler):
    def __init__(self, *names):
        self.names = names

    def ops(self):
        return {name: answering(lambda header, arrays: ({}, [])) for name in self.names}


def test_every_op_of_the_wire_protocol_has_one_handler():
    server = ShardServer(0, 1)
    assert set(server.loop.ops) == set(wire.OPS)
    handlers = {type(h).__name__ for h, _ in server.loop.ops.values()}
    assert handlers == {"RowOps", "StepOps", "GbaOps", "AdminOps"}
    with pytest.raises(HeraldError, match="two handlers"):
        registry([_Ops(*wire.OPS), _Ops("ping")])
    with pytest.raises(HeraldError, match="register a handler for every op"):
        registry([_Ops(*[op for op in wire.OPS if op != "gba_pull"])])


def test_an_answer_is_kept_only_for_a_mutating_request():
    header = {"x": 1}
    (reply,) = Request("peer", "push_rows", 7, (3, 7), {}, []).answer(header)
    assert isinstance(reply, Reply) and reply.peer == "peer" and reply.key == (3, 7)
    head = PS.unpack_header(reply.frames[0])
    assert {k: head[k] for k in ("op", "rid", "ok", "x")} == {"op": "push_rows", "rid": 7, "ok": True, "x": 1}
    (reply,) = Request("peer", "pull", 8, None, {}, []).answer({})
    assert reply.key is None
