"""A worker's cache saved at a checkpoint off the grid and loaded back (herald/worker/warm.py,
NOTE [warm resume] in herald/dispatch/warm.py): every key in the same slot with the same
row, the free slots in the same order, HET's clocks with them."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from herald.contracts.plan import KeySet
from herald.errors import DataError
from herald.worker.cache import EmbeddingCache
from herald.worker.clocks import CopyClocks
from herald.worker.device_cache import DeviceCache
from herald.worker.protocol import BSP
from herald.worker.warm import cache_file, load_cache, save_cache

CAP, WIDTH = 48, 3


def _ks(keys) -> KeySet:
    return KeySet(np.array([k[0] for k in keys], np.int32), np.array([k[1] for k in keys], np.uint64))


def _make(kind: str):
    return EmbeddingCache(CAP, WIDTH) if kind == "host" else DeviceCache(CAP, WIDTH, "cpu")


def _churn(cache, seed: int) -> None:
    """Random puts and evictions near capacity (a cache after some steps)."""
    rng = random.Random(seed)
    universe = [(t, i * 7919 + (2**63 if i % 2 else 0)) for t in range(3) for i in range(50)]
    held: set = set()
    for _ in range(60):
        victims = rng.sample(sorted(held), k=min(len(held), rng.randrange(0, 8)))
        cache.evict(_ks(victims), np.zeros(len(victims), bool))
        held -= set(victims)
        fresh = rng.sample([k for k in universe if k not in held], k=rng.randrange(0, CAP - len(held) + 1))
        cache.put(
            _ks(fresh), np.asarray([[rng.random() for _ in range(WIDTH)] for _ in fresh], np.float32).reshape(-1, WIDTH)
        )
        held |= set(fresh)


def _executor(cache, rank: int = 1):
    return types.SimpleNamespace(cache=cache, rank=rank)


@pytest.mark.parametrize("kind", ["host", "device"])
def test_a_saved_cache_loads_back_slot_for_slot(tmp_path, kind):
    cache = _make(kind)
    _churn(cache, 3)
    protocol = BSP(_executor(cache))
    path = save_cache(tmp_path, 1, _executor(cache), protocol)
    assert path == cache_file(tmp_path, 1) and path.stat().st_mode & 0o777 == 0o600

    again = _make(kind)
    load_cache(str(tmp_path), 1, _executor(again), BSP(_executor(again)))
    keys = cache.key_set()
    assert again.keys() == cache.keys() and len(again) == len(cache)
    assert np.array_equal(again.slots(keys), cache.slots(keys))
    assert np.array_equal(again.read(again.slots(keys)), cache.read(cache.slots(keys)))
    new = _ks([(2, 12345), (0, 54321)])  # the next inserts take the same free slots
    cache.put(new, np.ones((2, WIDTH), np.float32))
    again.put(new, np.ones((2, WIDTH), np.float32))
    assert np.array_equal(again.slots(new), cache.slots(new))


def test_the_bounded_clocks_travel_with_the_cache(tmp_path):
    cache = _make("host")
    _churn(cache, 5)
    ex = _executor(cache, rank=0)
    clocks = CopyClocks(ex, staleness=2)
    rng = np.random.default_rng(1)
    clocks.start[:] = rng.integers(0, 50, CAP).astype(np.uint64)
    clocks.current[:] = clocks.start + rng.integers(0, 3, CAP).astype(np.uint64)
    clocks.known[:] = rng.random(CAP) < 0.5
    protocol = types.SimpleNamespace(warm_arrays=clocks.arrays)
    save_cache(tmp_path, 0, ex, protocol)

    again = _make("host")
    ex2 = _executor(again, rank=0)
    loaded = CopyClocks(ex2, staleness=2)
    load_cache(str(tmp_path), 0, ex2, types.SimpleNamespace(load_warm_arrays=loaded.load_arrays))
    for name in ("start", "current", "known"):
        assert np.array_equal(getattr(loaded, name), getattr(clocks, name)), name
    with pytest.raises(DataError, match="no clocks"):  # saved under bsp, loaded under bounded
        save_cache(tmp_path, 0, ex, BSP(ex))
        load_cache(
            str(tmp_path), 0, _executor(_make("host"), 0), types.SimpleNamespace(load_warm_arrays=loaded.load_arrays)
        )


def test_a_missing_or_mismatched_cache_file_is_named(tmp_path):
    cache = _make("host")
    _churn(cache, 2)
    with pytest.raises(DataError, match="cache-rank0.npz"):
        load_cache(str(tmp_path), 0, _executor(_make("host"), 0), BSP(_executor(cache)))
    save_cache(tmp_path, 0, _executor(cache, 0), BSP(_executor(cache)))
    other = EmbeddingCache(CAP + 1, WIDTH)
    with pytest.raises(DataError, match="does not fit this cache of 49 rows"):
        load_cache(str(tmp_path), 0, _executor(other, 0), BSP(_executor(other)))
    with pytest.raises(DataError, match="4-float rows"):
        load_cache(str(tmp_path), 0, _executor(EmbeddingCache(CAP, WIDTH + 1), 0), BSP(_executor(cache)))
    (tmp_path / "cache-rank0.npz").write_bytes(b"torn")
    with pytest.raises(DataError, match="unreadable"):
        load_cache(str(tmp_path), 0, _executor(_make("host"), 0), BSP(_executor(cache)))
    with pytest.raises(DataError, match="names no checkpoint folder"):
        load_cache(None, 0, _executor(_make("host"), 0), BSP(_executor(cache)))
