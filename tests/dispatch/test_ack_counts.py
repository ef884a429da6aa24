"""NOTE [peer validation] of the ack's ``ps_requests`` count: optional, an int in [0, 2**63)."""

from __future__ import annotations

import hostile
import pytest

from herald.dispatch.peers import PeerTable


def bound_table() -> PeerTable:
    table = PeerTable(2)
    for rank, frames in enumerate(hostile.hellos(2)):
        assert table.admit([f"worker-{rank}".encode(), *frames]) is not None
    return table


@pytest.mark.parametrize("value", [0, 3, (1 << 63) - 1])
def test_an_ack_with_a_ps_requests_count_is_admitted(value):
    msg = bound_table().admit([b"worker-1", hostile.header("ack", rank=1, step=0, loss=0.5, ps_requests=value)])
    assert msg is not None and msg.header["ps_requests"] == value


@pytest.mark.parametrize("value", [-1, 1 << 63, 2.0, "3", True, None])
def test_an_ack_whose_ps_requests_is_not_a_count_is_rejected(value):
    table = bound_table()
    assert table.admit([b"worker-0", hostile.header("ack", rank=0, step=0, ps_requests=value)]) is None
    assert table.rejected["bad_field"] == 1
