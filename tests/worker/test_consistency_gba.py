"""The worker side of GBA (NOTE [gba tokens]): routing a contribution to every shard and
replaying the PS's aggregated dense gradients with the job's torch optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from herald.contracts.plan import KeySet
from herald.errors import ProtocolError
from herald.ps.rows import shard_of
from herald.worker.consistency_gba import GbaDense, route


def test_route_lists_every_shard_and_each_key_once():
    keys = KeySet(np.array([0, 0, 0, 2, 2], np.int32), np.array([1, 5, 9, 3, 4], np.uint64))
    out = route(keys, 3)
    assert len(out) == 3
    seen = np.zeros(len(keys), int)
    for s, parts in enumerate(out):
        for t, ids, at in parts:
            assert np.array_equal(keys.ids[at], ids) and (keys.table[at] == t).all()
            assert (shard_of(t, ids, 3) == s).all()
            seen[at] += 1
    assert seen.tolist() == [1] * 5
    assert route(KeySet.empty(), 2) == [[], []]  # an empty contribution still goes to every shard


def test_replay_steps_the_optimizer_once_per_kept_global_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    twin = torch.nn.Linear(3, 1)
    twin.load_state_dict(model.state_dict())
    dense = GbaDense(model, torch.optim.Adam(model.parameters(), lr=0.1))
    ref_opt = torch.optim.Adam(twin.parameters(), lr=0.1)
    grads = np.arange(8, dtype=np.float32).reshape(2, 4) / 10
    logged = np.concatenate([grads[:1], np.zeros((1, 4), np.float32), grads[1:]])
    dense.replay(0, logged, np.array([2, 0, 2], np.uint64))
    for g in grads:  # the same two Adam steps by hand; the dropped step (kept 0) is skipped
        twin.weight.grad, twin.bias.grad = torch.from_numpy(g[:3]).view(1, 3), torch.from_numpy(g[3:])
        ref_opt.step()
    assert dense.next_step == 3 and all(p.grad is None for p in model.parameters())
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)
    with pytest.raises(ProtocolError, match="3 expected"):
        dense.replay(5, np.zeros((1, 4), np.float32), np.ones(1, np.uint64))
    model.weight.grad = torch.ones(1, 3)
    assert dense.flat_grad(torch.tensor(2.0)).tolist() == [0.5, 0.5, 0.5, 0.0]
