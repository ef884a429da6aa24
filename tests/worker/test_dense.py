"""DenseSync handing its gradients to the step messages (NOTE [dense gradients on the
shards] in herald/ps/stepped.py): the flat buffer goes out, the sum comes back in place,
and a step without the sum is refused (the replicas would diverge)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from herald.errors import ProtocolError
from herald.ps.config import DENSE_MAX_BYTES
from herald.worker.dense import DenseSync


def _sync(width: int = 8) -> DenseSync:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    return DenseSync(model, torch.optim.SGD(model.parameters(), lr=0.5), world_size=2)


def _backward(sync: DenseSync) -> None:
    width = sync.model[0].in_features
    sync.model(torch.ones(3, width)).sum().backward()


def test_the_buffer_goes_out_and_its_sum_is_averaged_and_stepped():
    """start() returns the flat gradient buffer itself (no all-reduce: no process group
    here); what the step messages write into it is divided by the ranks and stepped."""
    sync = _sync()
    _backward(sync)
    before = [p.detach().clone() for p in sync.model.parameters()]
    mine = [p.grad.clone() for p in sync.model.parameters()]
    flat = sync.start()
    assert isinstance(flat, np.ndarray) and flat.dtype == np.float32
    assert flat.shape == (sum(p.numel() for p in sync.model.parameters()),)
    flat *= 3.0  # the shards' sum over the ranks: here, this rank's gradient times 3
    sync.step(summed=True)
    for p, b, g in zip(sync.model.parameters(), before, mine):
        assert torch.allclose(p.detach(), b - 0.5 * (3.0 * g / 2))
        assert not p.grad.any()  # zeroed, not freed: the buffer's views stay


def test_a_step_without_the_sum_is_refused():
    sync = _sync()
    _backward(sync)
    sync.start()
    with pytest.raises(ProtocolError, match="no sum came back"):
        sync.step(summed=False)


def test_a_large_model_is_all_reduced_instead():
    """Over DENSE_MAX_BYTES the buffer is not handed out: start() starts the all-reduce (here,
    without a process group, torch's error says so)."""
    width = DENSE_MAX_BYTES // 16 + 1
    sync = _sync(width)
    _backward(sync)
    with pytest.raises((RuntimeError, ValueError)):
        sync.start()
