import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herald import wire
from herald.contracts.microbatch import MicroBatch, make_sample_ids
from herald.contracts.plan import CachePlan, KeySet
from herald.dispatch.microbatch import build_microbatch
from herald.errors import ProtocolError
from herald.loader.batch import SampleBatch


def _plan():
    ks = KeySet(np.array([0, 1], np.int32), np.array([5, 2**64 - 1], np.uint64))
    return CachePlan(ks, np.array([True, False]), ks, ks, np.array([2, 3], np.uint16), ks, KeySet.empty())


def test_roundtrip_through_wire_keeps_every_bit():
    batch = SampleBatch(
        np.array([1, 0, 1], np.float32),
        np.arange(6, dtype=np.float32).reshape(3, 2),
        [np.array([7, 2**63 + 9, 7], np.uint64), np.array([11, 12, 13, 11], np.uint64)],
        [np.arange(4, dtype=np.int64), np.array([0, 2, 2, 4], np.int64)],
    )
    ids = make_sample_ids(3, 100, 3)
    mb = build_microbatch(7, 1, batch, ids, _plan())
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


# ------------------------------------------------- NOTE [micro-batch layout]
def _batch(rng, b=6, tables=3, max_len=3, vocab=5):
    values, offsets = [], []
    for _ in range(tables):
        lens = rng.integers(0, max_len + 1, b)
        o = np.zeros(b + 1, np.int64)
        np.cumsum(lens, out=o[1:])
        values.append(rng.integers(0, vocab, int(o[-1])).astype(np.uint64) * np.uint64(2**61))
        offsets.append(o)
    return SampleBatch(rng.random(b).astype(np.float32), rng.random((b, 2)).astype(np.float32), values, offsets)


def test_flat_arrays_and_per_table_views_match_np_unique():
    rng = np.random.default_rng(3)
    batch = _batch(rng)
    index = np.array([5, 0, 0, -1, 2])
    mb = build_microbatch(1, 0, batch, make_sample_ids(0, 0, 5), _plan(), index=index)
    sub = batch.take(index)
    assert mb.ids_flat.dtype == np.uint64 and mb.id_bounds.tolist()[0] == 0
    assert mb.offsets_flat.shape == (3, 6) and mb.inverse_flat.dtype == np.uint16
    for t in range(3):
        u, inv = np.unique(sub.values[t], return_inverse=True)
        assert np.array_equal(mb.unique_ids[t], u) and np.array_equal(mb.inverse[t], inv)
        assert np.array_equal(mb.offsets[t], sub.offsets[t]) and np.array_equal(mb.values(t), sub.values[t])
        assert np.shares_memory(mb.unique_ids[t], mb.ids_flat) or u.size == 0
    assert np.array_equal(mb.labels, sub.labels) and np.array_equal(mb.dense, sub.dense)


def test_inverse_is_int32_when_a_table_has_65536_values():
    n = 70_000
    batch = SampleBatch(
        np.zeros(1, np.float32),
        np.zeros((1, 0), np.float32),
        [np.arange(n, dtype=np.uint64) % np.uint64(70_001), np.array([4], np.uint64)],
        [np.array([0, n], np.int64), np.array([0, 1], np.int64)],
    )
    mb = build_microbatch(0, 0, batch, make_sample_ids(0, 0, 1), _plan())
    assert mb.inverse_flat.dtype == np.int32
    back = MicroBatch.from_frames(*wire.unpack(wire.pack(*mb.to_frames())))
    assert np.array_equal(back.values(0), batch.values[0]) and back.values(1).tolist() == [4]


def test_one_blob_frame_per_micro_batch():
    mb = build_microbatch(0, 0, _batch(np.random.default_rng(0)), make_sample_ids(0, 0, 6), _plan())
    header, arrays = mb.to_frames()
    assert len(arrays) == 1 and arrays[0].dtype == np.uint8
    assert [d[0] for d in header["parts"]][:3] == ["<u8", "<f4", "<f4"]


def _valid_message(seed: int):
    rng = np.random.default_rng(seed)
    mb = build_microbatch(2, 1, _batch(rng), make_sample_ids(0, 0, 6), _plan(), pull_early=np.array([True, False]))
    return wire.unpack(wire.pack(*mb.to_frames()))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h, a: h.update(layout=1), "layout"),
        (lambda h, a: h.update(tables=-1), "tables"),
        (lambda h, a: h["parts"].pop(), "parts"),
        (lambda h, a: h["parts"][5].__setitem__(0, "<i8"), "part 5"),
        (lambda h, a: h["parts"][2].__setitem__(1, [6, 2, 1]), "part 2"),
        (lambda h, a: h["parts"][3].__setitem__(1, [10**6]), "bytes"),
        (lambda h, a: a.append(a[0]), "one uint8"),
    ],
)
def test_malformed_descriptors_are_protocol_errors(mutate, match):
    header, arrays = _valid_message(0)
    mutate(header, arrays)
    with pytest.raises(ProtocolError, match=match):
        MicroBatch.from_frames(header, arrays)


def test_bad_bounds_and_inverse_are_protocol_errors():
    header, arrays = _valid_message(1)
    blob = arrays[0].copy()
    parts = MicroBatch.from_frames(header, [blob])
    offset_of = {
        name: part.ctypes.data - blob.ctypes.data
        for name, part in (
            ("id_bounds", parts.id_bounds),
            ("inverse", parts.inverse_flat),
            ("offsets", parts.offsets_flat),
        )
    }
    for name, value, match in (("id_bounds", 5, "id_bounds"), ("inverse", 60000, "inverse"), ("offsets", 3, "offsets")):
        bad = arrays[0].copy()
        dtype = {"id_bounds": np.int64, "inverse": np.uint16, "offsets": np.int64}[name]
        bad[offset_of[name] : offset_of[name] + np.dtype(dtype).itemsize] = np.array([value], dtype).view(np.uint8)
        with pytest.raises(ProtocolError, match=match):
            MicroBatch.from_frames(header, [bad])


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 3), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8), st.integers(-16, 16)
)
def test_corrupted_blobs_never_crash_the_decoder(seed, flips, resize):
    header, arrays = _valid_message(seed)
    blob = arrays[0].copy()
    for pos, byte in flips:
        blob[pos % blob.shape[0]] = byte
    if resize > 0:
        blob = np.concatenate([blob, np.zeros(resize, np.uint8)])
    elif resize < 0:
        blob = blob[:resize]
    try:
        mb = MicroBatch.from_frames(header, [blob])
    except ProtocolError:
        return
    for t in range(mb.num_tables):  # whatever passed the checks is usable
        mb.values(t)
