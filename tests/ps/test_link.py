"""The client's shard link (NOTE [ps client deadline]): the liveness seam of its wait."""

import pytest

from herald.errors import HeraldError, ProtocolError
from herald.ps.link import ShardLink

NOBODY = "inproc://herald-test-link-nobody"  # no shard binds it: nothing ever answers


def test_a_liveness_check_fails_the_wait_at_once():
    """A shard the check knows dead is named before its deadline (60 s here) comes."""
    link = ShardLink([NOBODY], timeout_ms=60_000, retries=0)
    asked = []

    def dead(shard):
        asked.append(shard)
        raise HeraldError(f"PS shard {shard} is dead")

    link.liveness = dead
    try:
        rid = link.send(0, "ping", {})
        with pytest.raises(HeraldError, match="PS shard 0 is dead"):
            link.collect([rid])
        assert asked == [0]
        with pytest.raises(ProtocolError, match="abandoned"):  # the operation was given up whole
            link.collect([rid])
    finally:
        link.close()


def test_the_wait_asks_the_check_again_while_it_waits():
    link = ShardLink([NOBODY], timeout_ms=60_000, retries=0)
    asked = []

    def dies_later(shard):
        asked.append(shard)
        if len(asked) == 4:
            raise HeraldError("gone")

    link.liveness = dies_later
    try:
        with pytest.raises(HeraldError, match="gone"):
            link.collect([link.send(0, "ping", {})])
        assert asked == [0, 0, 0, 0]  # asked once per poll of at most LIVENESS_POLL_MS
    finally:
        link.close()
