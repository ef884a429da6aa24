"""The device-resident cache (NOTE [device cache]) equals the host cache and its numba
kernels on random plan workloads: evictions with write-backs, pulls (puts), lookups,
local sparse updates with each optimizer, plan-push reads, flushes.

Run on CPU tensors everywhere (CI has no GPU); the ``cuda`` cases run where CUDA is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from herald.contracts.plan import KeySet
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ConfigError, ProtocolError
from herald.ps import apply_gradients
from herald.worker.cache import EmbeddingCache
from herald.worker.device_cache import DeviceCache, make_cache
from herald.worker.kernels_torch import apply_rows_torch

TOL = 1e-6
DIM = 8
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
    ),
]
OPTIMIZERS = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("sgd", lr=0.1, weight_decay=0.01),
    OptimizerConfig("adagrad", lr=0.05, initial_accumulator=0.1),
    OptimizerConfig("adagrad", lr=0.05, weight_decay=0.001),
    OptimizerConfig("rowwise_adagrad", lr=0.05),
    OptimizerConfig("rowwise_adagrad", lr=0.05, eps=1e-6),
    OptimizerConfig("adam", lr=0.01),
    OptimizerConfig("adam", lr=0.01, beta1=0.8, weight_decay=0.01),
]
IDS = [f"{o.name}-wd{o.weight_decay:g}-eps{o.eps:g}" for o in OPTIMIZERS]


def _rows(rng: np.random.Generator, n: int, table: TableConfig) -> np.ndarray:
    """Valid rows of ``table`` as a PS sends them: accumulators >= 0, Adam step counts whole."""
    rows = rng.normal(0, 0.5, (n, table.row_width)).astype(np.float32)
    rows[:, DIM:] = np.abs(rows[:, DIM:])
    if table.optimizer.name == "adam":
        rows[:, 3 * DIM] = rng.integers(0, 100, n)
    return rows


def _keys(pairs) -> KeySet:
    pairs = list(pairs)
    return KeySet(np.array([p[0] for p in pairs], np.int32), np.array([p[1] for p in pairs], np.uint64))


def _close(got, want, what: str) -> None:
    got = got.detach().to("cpu").numpy() if isinstance(got, torch.Tensor) else got
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=IDS)
def test_device_cache_equals_host_cache_on_random_plans(device, opt):
    rng = np.random.default_rng(OPTIMIZERS.index(opt))
    table = TableConfig("t", DIM, opt)
    cap = 48
    host, dev = EmbeddingCache(cap, table.row_width), DeviceCache(cap, table.row_width, device)
    universe = [(t, i + (2**63 if i % 5 == 0 else 0)) for t in range(3) for i in range(40)]
    cached: list = []
    for _ in range(60):
        # 1. evict with write-back
        victims = [cached[i] for i in rng.permutation(len(cached))[: rng.integers(0, 10)]]
        wb = rng.random(len(victims)) < 0.5
        _close(dev.evict(_keys(victims), wb), host.evict(_keys(victims), wb), "write-back rows")
        cached = [k for k in cached if k not in set(victims)]
        # 2. pull: new keys into free slots, some cached ones overwritten (update pulls)
        fresh = [k for k in universe if k not in set(cached)]
        new = [fresh[i] for i in rng.permutation(len(fresh))[: rng.integers(0, cap - len(cached) + 1)]]
        again = [cached[i] for i in rng.permutation(len(cached))[: rng.integers(0, 4)]]
        pulled = _rows(rng, len(new) + len(again), table)
        for cache in (host, dev):
            cache.put(_keys(new + again), pulled)
        cached += new
        assert dev.keys() == host.keys() and len(dev) == len(host) == len(cached)
        if not cached:
            continue
        # 3. lookup: the step's rows, in any order
        used = [cached[i] for i in rng.permutation(len(cached))[: rng.integers(1, len(cached) + 1)]]
        slots = host.slots(_keys(used))
        assert np.array_equal(dev.slots(_keys(used)), slots), "both caches put every key in the same slot"
        _close(dev.gather(slots, DIM, torch.device(device)), host.gather(slots, DIM, torch.device("cpu")), "lookup")
        # 4. local sparse update of a subset, gradients indexed by the step's row order
        grads = rng.normal(0, 1, (len(used), DIM)).astype(np.float32)
        mine = rng.permutation(len(used))[: rng.integers(0, len(used) + 1)]
        host.apply_gradients(slots[mine], torch.from_numpy(grads), mine, table)
        dev.apply_gradients(slots[mine], torch.from_numpy(grads).to(device), mine, table)
        # 5. plan push: read a subset back
        pushed = slots[rng.permutation(len(slots))[: rng.integers(0, len(slots) + 1)]]
        _close(dev.read(pushed), host.read(pushed), "plan-push rows")
    everything = host.slots(_keys(cached))
    _close(dev.read(everything), host.read(everything), "every cached row at the end (flush)")
    for cache in (host, dev):
        cache.clear()
    assert len(dev) == 0 and dev.keys() == set()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=IDS)
def test_torch_optimizers_equal_the_ps_kernels_over_many_steps(device, opt):
    """The same row updated 30 times (Adam's per-row step count and bias corrections
    move, accumulators grow) by the numba kernel and by its torch twin."""
    rng = np.random.default_rng(7)
    table = TableConfig("t", DIM, opt)
    want = _rows(rng, 64, table)
    got = torch.from_numpy(want.copy()).to(device)
    for _ in range(30):
        g = rng.normal(0, 1, (64, DIM)).astype(np.float32)
        g[rng.random(64) < 0.1] = 0.0  # rows without gradient this step still get a step (as at the PS)
        apply_gradients(want, g, table)
        got = apply_rows_torch(got, torch.from_numpy(g).to(device), table)
    _close(got, want, f"{opt.name} after 30 steps")
    if device == "cpu":
        assert np.array_equal(got.numpy(), want), "on the CPU the torch twin is bit-identical to the numba kernel"


def test_device_cache_rejects_plans_that_break_it():
    cache = DeviceCache(2, 1, "cpu")
    cache.put(_keys([(0, 1), (0, 2)]), np.zeros((2, 1), np.float32))
    with pytest.raises(ProtocolError, match="free slots"):
        cache.put(_keys([(0, 3)]), np.zeros((1, 1), np.float32))
    with pytest.raises(ProtocolError, match="snapshot disagree"):
        cache.slots(_keys([(1, 1)]))
    with pytest.raises(ProtocolError, match="do not match"):
        cache.put(_keys([(0, 1)]), np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="grads must be float32"):  # narrower than the table (wider: padded)
        cache.apply_gradients(np.array([0]), torch.zeros(1, 0), np.array([0]), TableConfig("t", 1))
    with pytest.raises(ConfigError, match="wider than the cache"):
        cache.apply_gradients(np.array([0]), torch.zeros(1, 2), np.array([0]), TableConfig("t", 2))


def test_make_cache_builds_the_named_kind():
    assert type(make_cache("host", 4, 2, torch.device("cpu"))) is EmbeddingCache
    dev = make_cache("torch", 4, 2, torch.device("cpu"))
    assert type(dev) is DeviceCache and isinstance(dev.rows, torch.Tensor) and dev.rows.shape == (4, 2)
    with pytest.raises(ValueError, match="'host' or 'torch'"):
        make_cache("gpu", 4, 2, torch.device("cpu"))
