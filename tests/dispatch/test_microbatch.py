import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from herald import wire
from herald.errors import ProtocolError
from herald.loader.batch import SampleBatch
from herald.scheduler.plan import CachePlan, KeySet
from herald.dispatch.microbatch import MicroBatch, make_sample_ids


def _plan():
    ks = KeySet(np.array([0, 1], np.int32), np.array([5, 2**64 - 1], np.uint64))
    return CachePlan(ks, np.array([True, False]), ks, ks, np.array([2, 3], np.uint16), ks, KeySet.empty())


def test_roundtrip_through_wire_keeps_every_bit():
    batch = SampleBatch(np.array([1, 0, 1], np.float32), np.arange(6, dtype=np.float32).reshape(3, 2),
                        [np.array([7, 2**63 + 9, 7], np.uint64), np.array([11, 12, 13, 11], np.uint64)],
                        [np.arange(4, dtype=np.int64), np.array([0, 2, 2, 4], np.int64)])
    ids = make_sample_ids(3, 100, 3)
    mb = MicroBatch.build(7, 1, batch, ids, _plan())
    assert mb.inverse[0].dtype == np.uint16 and mb.unique_ids[0].tolist() == [7, 2**63 + 9]
    frames = wire.pack(*mb.to_frames())
    back = MicroBatch.from_frames(*wire.unpack([bytes(memoryview(f)) for f in frames]))
    assert back.step == 7 and back.rank == 1
    assert back.values(1).tolist() == [11, 12, 13, 11] and back.values(0).tolist() == [7, 2**63 + 9, 7]
    assert (back.sample_ids >> np.uint64(56)).tolist() == [3, 3, 3]
    assert back.plan.pull.as_set() == {(0, 5), (1, 2**64 - 1)}
    assert back.plan.write_back.tolist() == [True, False] and back.plan.contributors.tolist() == [2, 3]


def test_header_and_frame_sizes_are_checked():
    frames = wire.pack({"op": "x"}, [np.zeros(4, np.float32)])
    with pytest.raises(ProtocolError, match="bytes"):
        wire.unpack([frames[0], b"\0" * 15])
    with pytest.raises(ProtocolError, match="array frames"):
        wire.unpack([frames[0]])
    import msgpack
    with pytest.raises(ProtocolError, match="not allowed"):
        wire.unpack([msgpack.packb({"v": 1, "op": "x", "arrays": [["|O", [1]]]}), b"\0" * 8])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_random_frames_never_crash_the_decoder(frames):
    try:
        header, arrays = wire.unpack(frames)
        MicroBatch.from_frames(header, arrays)
    except ProtocolError:
        pass
