"""Row functions shared by PS and worker: init, sharding, optimizers vs torch (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ConfigError
from herald.ps import apply_gradients, init_rows, shard_of

KEYS = np.array([0, 1, 2, 2**63, 2**64 - 1, 123456789012345678], np.uint64)


def test_state_dims_and_row_width():
    for name, sd in [("sgd", 0), ("adagrad", 16), ("rowwise_adagrad", 1), ("adam", 33)]:
        opt = OptimizerConfig(name=name)
        assert opt.state_dim(16) == sd
        assert TableConfig("t", 16, opt).row_width == 16 + sd


def test_bad_settings_raise():
    with pytest.raises(ConfigError):
        OptimizerConfig(name="rmsprop")
    with pytest.raises(ConfigError):
        TableConfig("t", 0)
    with pytest.raises(ConfigError):
        TableConfig.from_dict({"name": "t", "dim": 4, "colour": "red"})
    with pytest.raises(ConfigError):
        init_rows(TableConfig("t", 4), 0, np.arange(3, dtype=np.int64), 0)


def test_init_is_deterministic_and_keyed():
    t = TableConfig("t", 8, OptimizerConfig("adagrad", initial_accumulator=0.1), init="uniform", init_scale=0.5)
    a = init_rows(t, 0, KEYS, seed=7)
    assert np.array_equal(a, init_rows(t, 0, KEYS[::-1], seed=7)[::-1])  # per key, not per position
    assert not np.array_equal(a, init_rows(t, 1, KEYS, seed=7))  # per table
    assert not np.array_equal(a, init_rows(t, 0, KEYS, seed=8))  # per seed
    assert np.all(np.abs(a[:, :8]) <= 0.5) and np.all(a[:, 8:] == np.float32(0.1))
    big = init_rows(t, 0, np.arange(20000, dtype=np.uint64), seed=1)[:, :8]
    assert abs(big.mean()) < 0.01 and abs(big.std() - 0.5 / np.sqrt(3)) < 0.01
    n = init_rows(TableConfig("n", 8, init="normal", init_scale=2.0), 0, np.arange(20000, dtype=np.uint64), 1)
    assert abs(n.mean()) < 0.05 and abs(n.std() - 2.0) < 0.05
    z = init_rows(TableConfig("z", 4, OptimizerConfig("adam"), init="zeros"), 0, KEYS, 1)
    assert z.shape == (6, 4 + 9) and not z.any()


def test_shard_of_spreads_every_table_evenly():
    keys = np.arange(200_000, dtype=np.uint64)  # sequential ids: the worst case for a modulo
    for table in (0, 1, 5):
        counts = np.bincount(shard_of(table, keys, 4), minlength=4)
        assert counts.min() > 0.97 * 50_000 and counts.max() < 1.03 * 50_000
    assert not np.array_equal(shard_of(0, keys[:100], 4), shard_of(1, keys[:100], 4))
    assert shard_of(0, KEYS, 1).tolist() == [0] * len(KEYS)


def _torch_reference(opt: OptimizerConfig, w0: np.ndarray, grads: list[np.ndarray]):
    w = torch.tensor(w0.copy(), requires_grad=True)
    if opt.name == "sgd":
        o = torch.optim.SGD([w], lr=opt.lr, weight_decay=opt.weight_decay)
    elif opt.name == "adagrad":
        o = torch.optim.Adagrad(
            [w],
            lr=opt.lr,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            initial_accumulator_value=opt.initial_accumulator,
        )
    elif opt.name == "adam":
        o = torch.optim.Adam([w], lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay)
    else:
        o = None
        state = torch.full((w0.shape[0], 1), opt.initial_accumulator)
    for g in grads:
        gt = torch.tensor(g)
        if o is not None:
            w.grad = gt
            o.step()
        else:  # row-wise Adagrad (FBGEMM): one accumulator per row, mean of squares
            with torch.no_grad():
                gt = gt + opt.weight_decay * w
                state += (gt * gt).mean(dim=1, keepdim=True)
                w -= opt.lr * gt / (state.sqrt() + opt.eps)
    if o is None:
        return w.detach().numpy(), state.numpy()
    st = o.state[w]
    if opt.name == "adagrad":
        return w.detach().numpy(), st["sum"].numpy()
    if opt.name == "adam":
        n = w0.shape[0]
        steps = np.full((n, 1), float(st["step"]), np.float32)
        return w.detach().numpy(), np.hstack([st["exp_avg"].numpy(), st["exp_avg_sq"].numpy(), steps])
    return w.detach().numpy(), np.zeros((w0.shape[0], 0), np.float32)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_apply_gradients_matches_torch(name, wd):
    opt = OptimizerConfig(name=name, lr=0.05, initial_accumulator=0.1, weight_decay=wd)
    t = TableConfig("t", 16, opt, init="normal", init_scale=0.1)
    keys = np.arange(300, dtype=np.uint64) * 977
    rows = init_rows(t, 0, keys, seed=3)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((300, 16)).astype(np.float32) for _ in range(5)]
    w_ref, s_ref = _torch_reference(opt, rows[:, :16], grads)
    for g in grads:
        apply_gradients(rows, g, t)
    np.testing.assert_allclose(rows[:, :16], w_ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(rows[:, 16:], s_ref, rtol=2e-5, atol=1e-7)


def test_apply_gradients_validates():
    t = TableConfig("t", 4, OptimizerConfig("adam"))
    rows = np.zeros((3, t.row_width), np.float32)
    with pytest.raises(ConfigError):
        apply_gradients(rows, np.zeros((3, 5), np.float32), t)
    with pytest.raises(ConfigError):
        apply_gradients(rows[:, :8], np.zeros((3, 4), np.float32), t)
    with pytest.raises(ConfigError):
        apply_gradients(rows.astype(np.float64), np.zeros((3, 4), np.float32), t)
