"""The shared (table, id) -> slot map (NOTE [key map]) against a Python dict."""

from __future__ import annotations

import numpy as np
import pytest

from herald import keymap as KM
from herald.hashing import splitmix64

EDGE_IDS = np.array([0, 1, 2**63, 2**64 - 2, 2**64 - 1], np.uint64)


def _keys(rng, n: int, num_tables: int, id_range: int):
    """Random keys with repeats, the edge ids in every table, ids spread over all 64 bits."""
    ids = rng.integers(0, id_range, n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    tabs = rng.integers(0, num_tables, n).astype(np.int16)
    edge_t = np.repeat(np.arange(num_tables, dtype=np.int16), EDGE_IDS.shape[0])
    edge_v = np.tile(EDGE_IDS, num_tables)
    order = rng.permutation(n + edge_v.shape[0])
    return np.concatenate([tabs, edge_t])[order], np.concatenate([ids, edge_v])[order]


class _Map:
    """A growing map as the scheduler keeps one (slots in lookup order)."""

    def __init__(self, capacity: int):
        self.slot_ids = np.zeros(capacity, np.uint64)
        self.slot_tab = np.zeros(capacity, np.int16)
        self.n = np.zeros(1, np.int64)
        self.buckets = KM.new_buckets(capacity, self.slot_ids, self.slot_tab, 0)
        self.grown = 0

    def grow(self) -> None:
        S = self.slot_ids.shape[0]
        for name in ("slot_ids", "slot_tab"):
            old = getattr(self, name)
            new = np.zeros(2 * S, old.dtype)
            new[:S] = old
            setattr(self, name, new)
        self.buckets = KM.new_buckets(2 * S, self.slot_ids, self.slot_tab, int(self.n[0]))
        self.grown += 1

    def lookup(self, tabs, ids) -> np.ndarray:
        out = np.empty(ids.shape[0], np.int32)
        done = 0
        while done < ids.shape[0]:
            done += KM.find_or_insert_many_jit(
                self.buckets, self.slot_ids, self.slot_tab, self.n, tabs[done:], ids[done:], out[done:]
            )
            if done < ids.shape[0]:
                self.grow()
        return out


def _reference(tabs, ids) -> np.ndarray:
    ref: dict[tuple[int, int], int] = {}
    return np.array([ref.setdefault(k, len(ref)) for k in zip(tabs.tolist(), ids.tolist())], np.int64)


@pytest.mark.parametrize("seed", range(3))
def test_find_or_insert_grows_and_matches_a_dict(seed):
    rng = np.random.default_rng(seed)
    tabs, ids = _keys(rng, 60_000, num_tables=5, id_range=8_000)
    m = _Map(16)
    got = np.concatenate(
        [m.lookup(tabs[lo : lo + 7_000], ids[lo : lo + 7_000]) for lo in range(0, ids.shape[0], 7_000)]
    )
    ref = _reference(tabs, ids)
    assert np.array_equal(got, ref)  # slots in lookup order, equal keys -> equal slot
    assert m.grown >= 10 and int(m.n[0]) == ref.max() + 1
    assert m.buckets.shape[0] >= 2 * int(m.n[0])  # load <= 1/2
    found = np.empty(ids.shape[0], np.int64)
    assert KM.find_many_jit(m.buckets, m.slot_ids, m.slot_tab, tabs, ids, found) == ids.shape[0]
    assert np.array_equal(found, ref)
    # the same ids in a table never used, and unseen ids, are absent
    assert KM.find_many_jit(m.buckets, m.slot_ids, m.slot_tab, np.int16(7), ids, found) == 0
    assert (found == -1).all()
    assert (
        KM.find_jit(m.buckets, m.slot_ids, m.slot_tab, np.int16(2), np.uint64(2**64 - 1))
        == ref[np.flatnonzero((tabs == 2) & (ids == np.uint64(2**64 - 1)))[0]]
    )


def test_one_table_map_takes_a_scalar_table():
    """The PS form: one map per table, ``slot_tab`` and ``tables`` one int."""
    rng = np.random.default_rng(7)
    ids = np.concatenate([EDGE_IDS, rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64, endpoint=True), EDGE_IDS])
    row_keys = np.zeros(ids.shape[0], np.uint64)
    buckets = KM.new_buckets(ids.shape[0], row_keys, 0, 0, np.int64)
    n = np.zeros(1, np.int64)
    out = np.empty(ids.shape[0], np.int64)
    assert KM.find_or_insert_many_jit(buckets, row_keys, 0, n, 0, ids, out) == ids.shape[0]
    ref = _reference(np.zeros(ids.shape[0], np.int16), ids)
    assert np.array_equal(out, ref)
    assert np.array_equal(row_keys[: n[0]], ids[np.sort(np.unique(ids, return_index=True)[1])])
    rebuilt = KM.new_buckets(4 * ids.shape[0], row_keys, 0, int(n[0]), np.int64)
    again = np.empty_like(out)
    assert KM.find_many_jit(rebuilt, row_keys, 0, 0, ids, again) == ids.shape[0]
    assert np.array_equal(again, ref)


def test_tables_form_equals_the_concatenation():
    rng = np.random.default_rng(3)
    values = tuple(
        np.concatenate([EDGE_IDS, rng.integers(0, 500, rng.integers(0, 3_000), dtype=np.uint64)]) for _ in range(6)
    )
    tabs = np.repeat(np.arange(6, dtype=np.int16), [v.shape[0] for v in values])
    ids = np.concatenate(values)
    ref = _reference(tabs, ids)
    m = _Map(64)  # too small: the kernel stops where the slots run out
    out = np.empty(ids.shape[0], np.int32)
    done = KM.find_or_insert_tables_jit(m.buckets, m.slot_ids, m.slot_tab, m.n, values, out)
    assert 0 < done < ids.shape[0] and int(m.n[0]) == 64
    assert np.array_equal(out[:done], ref[:done])
    out[done:] = m.lookup(tabs[done:], ids[done:])
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("seed", range(3))
def test_insert_delete_churn_matches_a_dict(seed):
    """The worker cache's use: slots from a free list, deletions every round, near full
    load (long probe clusters, so backward-shift deletion is exercised)."""
    rng = np.random.default_rng(seed)
    cap = 500
    buckets = np.full(KM.bucket_count(cap), -1, np.int32)
    slot_ids = np.zeros(cap, np.uint64)
    slot_tab = np.zeros(cap, np.int32)
    free = list(range(cap))
    ref: dict[tuple[int, int], int] = {}
    universe = [(int(t), int(v)) for t, v in zip(*_keys(rng, 3_000, num_tables=3, id_range=2**40))]
    for _ in range(60):
        gone = [k for k in ref if rng.random() < 0.3]
        if gone:
            out = np.empty(len(gone), np.int64)
            KM.delete_many_jit(
                buckets,
                slot_ids,
                slot_tab,
                np.array([k[0] for k in gone], np.int32),
                np.array([k[1] for k in gone], np.uint64),
                out,
            )
            assert out.tolist() == [ref[k] for k in gone]
            for k in gone:
                free.append(ref.pop(k))
        absent = [k for k in dict.fromkeys(universe[i] for i in rng.integers(0, len(universe), 300)) if k not in ref][
            : len(free)
        ]
        slots = np.array([free.pop() for _ in absent], np.int64)
        new = KM.insert_many_jit(
            buckets,
            slot_ids,
            slot_tab,
            np.array([k[0] for k in absent], np.int32),
            np.array([k[1] for k in absent], np.uint64),
            slots,
        )
        assert new == len(absent)
        ref.update(zip(absent, slots.tolist()))
        probe = list(ref) + universe[:200]
        out = np.empty(len(probe), np.int64)
        KM.find_many_jit(
            buckets,
            slot_ids,
            slot_tab,
            np.array([k[0] for k in probe], np.int32),
            np.array([k[1] for k in probe], np.uint64),
            out,
        )
        assert out.tolist() == [ref.get(k, -1) for k in probe]
        assert int((buckets >= 0).sum()) == len(ref)
    missing = np.empty(1, np.int64)
    KM.delete_many_jit(buckets, slot_ids, slot_tab, np.array([9], np.int32), np.array([5], np.uint64), missing)
    assert missing[0] == -1


def test_key_hash_is_the_documented_splitmix64():
    rng = np.random.default_rng(1)
    for t, v in [(0, 0), (0, 2**64 - 1), (25, 2**63)] + [
        (int(rng.integers(0, 30)), int(x)) for x in rng.integers(0, 2**64 - 1, 50, dtype=np.uint64)
    ]:
        want = splitmix64(v ^ (((t + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1)))
        assert int(KM.key_hash_jit(np.int16(t), np.uint64(v))) == want


def test_bucket_count_keeps_load_at_most_half():
    assert KM.bucket_count(0) == 16 and KM.bucket_count(8) == 16 and KM.bucket_count(9) == 32
    for n in (1, 100, 1000, 4097):
        h = KM.bucket_count(n)
        assert h & (h - 1) == 0 and h >= 2 * n and h < 4 * n + 16
