import random

import numpy as np
import pytest

from herald.errors import ProtocolError
from herald.scheduler.plan import KeySet
from herald.worker.cache import EmbeddingCache


def _ks(keys):
    return KeySet(np.array([k[0] for k in keys], np.int32), np.array([k[1] for k in keys], np.uint64))


@pytest.mark.parametrize("seed", range(4))
def test_cache_matches_dict_under_random_plans(seed):
    """Random evict/put sequences near full capacity (stresses backward-shift deletion)."""
    rng = random.Random(seed)
    cap = 64
    cache, ref = EmbeddingCache(cap, 2), {}
    universe = [(t, i + (2**63 + 7 if i % 3 == 0 else 0)) for t in range(3) for i in range(60)]
    for _ in range(400):
        victims = rng.sample(sorted(ref), k=min(len(ref), rng.randrange(0, 12)))
        wb = np.array([rng.random() < 0.5 for _ in victims], bool)
        out = cache.evict(_ks(victims), wb)
        assert np.array_equal(out, np.array([ref[k] for k, w in zip(victims, wb) if w], np.float32).reshape(-1, 2))
        for k in victims:
            del ref[k]
        room = cap - len(ref)
        fresh = rng.sample([k for k in universe if k not in ref], k=rng.randrange(0, room + 1))
        again = rng.sample(sorted(ref), k=min(len(ref), 3))
        keys = fresh + again
        rows = np.array([[rng.random(), rng.random()] for _ in keys], np.float32).reshape(-1, 2)
        cache.put(_ks(keys), rows)
        ref.update({k: r for k, r in zip(keys, rows)})
        assert cache.keys() == set(ref) and len(cache) == len(ref)
    got = cache.rows[cache.slots(_ks(sorted(ref)))]
    assert np.array_equal(got, np.array([ref[k] for k in sorted(ref)], np.float32))


def test_cache_rejects_plans_that_break_it():
    cache = EmbeddingCache(2, 1)
    cache.put(_ks([(0, 1), (0, 2)]), np.zeros((2, 1), np.float32))
    with pytest.raises(ProtocolError, match="free slots"):
        cache.put(_ks([(0, 3)]), np.zeros((1, 1), np.float32))
    with pytest.raises(ProtocolError, match="snapshot disagree"):
        cache.slots(_ks([(1, 1)]))
