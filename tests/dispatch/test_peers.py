"""NOTE [peer validation] without sockets: :class:`PeerTable` classifies every message
exactly, binds identities first-come, never raises, and logs once per kind."""

from __future__ import annotations

import logging

import hostile
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herald import wire
from herald.dispatch.peers import KINDS, PeerTable, printable

WORKERS, ROWS = 2, 4


def kind_of(table: PeerTable, identity: bytes, frames: list) -> str | None:
    """The kind ``frames`` from ``identity`` was rejected as, or None when admitted."""
    before = dict(table.rejected)
    msg = table.admit([identity, *frames])
    grown = [k for k in KINDS if table.rejected[k] != before[k]]
    assert (msg is None) == bool(grown) and len(grown) <= 1, (msg, grown)
    assert all(table.rejected[k] - before[k] == 1 for k in grown)
    return grown[0] if grown else None


def bound_table(rows: int | None = ROWS) -> PeerTable:
    table = PeerTable(WORKERS)
    for rank in range(WORKERS):
        assert kind_of(table, f"worker-{rank}".encode(), hostile.hellos(WORKERS)[rank]) is None
    table.ack_rows = rows
    return table


@pytest.mark.parametrize(
    "kind,messages",
    [
        ("undecodable", hostile.undecodable()),
        ("unknown_op", hostile.unknown_ops()),
        ("bad_field", hostile.bad_fields(0, WORKERS, ROWS)),
    ],
)
@pytest.mark.parametrize("sender", [b"worker-0", b"stranger"])
def test_each_malformed_message_is_rejected_as_its_kind_whoever_sends_it(kind, messages, sender):
    table = bound_table()
    for frames in messages:
        assert kind_of(table, sender, frames) == kind, [f[:60] for f in frames]
    assert table.rejected == {**dict.fromkeys(KINDS, 0), kind: len(messages)}


def test_valid_messages_from_a_bound_identity_are_admitted_with_its_rank():
    table = bound_table()
    for frames in hostile.claims(1, ROWS, step=3):
        msg = table.admit([b"worker-1", *frames])
        assert msg is not None and msg.rank == 1 and msg.identity == b"worker-1"
        assert msg.header == wire.unpack(frames)[0]
    ack = table.admit([b"worker-1", *hostile.claims(1, ROWS)[0]])
    assert [a.dtype for a in ack.arrays] == [np.float32] * 2 and [a.shape for a in ack.arrays] == [(ROWS,)] * 2
    assert sum(table.rejected.values()) == 0


def test_claims_from_strangers_and_from_another_rank_are_rejected():
    table = bound_table()
    for frames in hostile.claims(0, ROWS):
        assert kind_of(table, b"stranger", frames) == "unknown_peer"
        assert kind_of(table, b"worker-1", frames) == "wrong_identity"  # rank 1's identity claims rank 0
        assert table.admit([b"worker-0", *frames]) is not None


def test_ack_arrays_must_have_the_micro_batch_size_once_it_is_known():
    table = bound_table(rows=None)  # before the first step: two equal float32 vectors
    assert table.admit([b"worker-0", *hostile.claims(0, ROWS + 3)[0]]) is not None
    table.ack_rows = ROWS
    assert kind_of(table, b"worker-0", hostile.claims(0, ROWS + 3)[0]) == "bad_field"
    assert table.admit([b"worker-0", *hostile.claims(0, ROWS)[0]]) is not None


def test_first_hello_binds_and_is_never_replaced():
    table = PeerTable(WORKERS)
    hello0, hello1 = hostile.hellos(WORKERS)
    assert table.missing() == [0, 1] and not table.complete
    assert kind_of(table, b"first", hello0) is None
    assert kind_of(table, b"second", hello0) == "duplicate_hello"  # another identity, same rank
    assert kind_of(table, b"first", hello0) == "duplicate_hello"  # the same hello again
    assert kind_of(table, b"first", hello1) == "duplicate_hello"  # one identity, one rank
    assert table.identities == {0: b"first"} and table.missing() == [1]
    assert kind_of(table, b"other", hello1) is None
    assert table.complete and table.identities == {0: b"first", 1: b"other"}
    assert kind_of(table, b"late", hello1) == "duplicate_hello"
    assert kind_of(table, b"second", hostile.claims(0, ROWS)[-1]) == "unknown_peer"  # its error changes nothing
    assert table.identities == {0: b"first", 1: b"other"}
    assert table.rejected["duplicate_hello"] == 4


def test_each_kind_is_logged_once_with_the_escaped_identity(caplog):
    table = bound_table()
    evil = b"ev\xffil\n\x07" + b"x" * 100
    with caplog.at_level(logging.WARNING, logger="herald.dispatch.peers"):
        for _ in range(3):
            for frames in hostile.undecodable()[:3] + hostile.unknown_ops() + hostile.bad_fields(0, WORKERS, ROWS)[4:5]:
                table.admit([evil, *frames])
    lines = [r.getMessage() for r in caplog.records]
    assert [k for line in lines for k in KINDS if f"({k})" in line] == ["undecodable", "unknown_op", "bad_field"]
    assert all(r"b'ev\xffil\n\x07xxx" in line and "..." in line and "\n" not in line for line in lines)
    assert "--world-size 2" in lines[2]  # the first bad field says the fix
    assert table.rejected["undecodable"] == 9 and table.rejected["unknown_op"] == 12


def test_printable_escapes_and_bounds_any_identity():
    assert printable(b"worker-0") == "b'worker-0'"
    assert printable(bytes(range(4))) == r"b'\x00\x01\x02\x03'"
    assert printable(b"a" * 300, limit=8) == "b'aaaaaaaa'..."


_values = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.floats(),
    st.lists(st.integers(0, 8), max_size=3),
    st.dictionaries(st.text(max_size=3), st.floats(), max_size=2),
)
_headers = st.fixed_dictionaries(
    {
        "v": st.sampled_from([wire.DISPATCH.version]) | _values,
        "op": st.sampled_from(["hello", "ack", "flushed", "saved", "error", "config"]) | _values,
        "arrays": st.sampled_from([[], [["<f4", [4]], ["<f4", [4]]], [["<f8", [2]]]]) | _values,
    },
    optional={
        k: st.integers(-1, 3) | _values
        for k in ("rank", "world_size", "step", "loss", "bytes_pulled", "phases_ms", "message")
    },
)


@settings(max_examples=400, deadline=None)
@given(
    identity=st.sampled_from([b"worker-0", b"worker-1", b"stranger"]) | st.binary(min_size=1, max_size=255),
    head=st.one_of(_headers.map(msgpack.packb), st.binary(max_size=64)),
    arrays=st.lists(st.sampled_from([b"", b"\x00" * 16, b"\x00" * 8]), max_size=3),
)
def test_admit_never_raises_counts_every_rejection_and_keeps_the_bindings(identity, head, arrays):
    table = bound_table()
    msg = table.admit([identity, head, *arrays])
    assert (msg is None) == (sum(table.rejected.values()) == 1)
    assert table.identities == {0: b"worker-0", 1: b"worker-1"}
    if msg is not None:
        assert msg.identity == identity == table.identities[msg.rank]
