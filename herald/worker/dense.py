"""The dense synchroniser: average the dense gradients over the ranks, then step.

Step 7 of NOTE [step protocol] (``herald/scheduler/plan.py``). Every rank holds the
same dense replica (same seed, same averaged gradients), as in data-parallel training.
"""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist
from torch import nn

from herald.worker.devices import group_for


class DenseSync:
    """All-reduce of one flat gradient buffer, then the optimizer step.

    After the first step every ``p.grad`` is a view into one flat buffer, so
    ``backward()`` accumulates in place (grads are zeroed, not freed) and the
    all-reduce needs no concatenation or copy-back (DDP's gradient-as-bucket-view).

    Args:
        model: the dense model (the same initial parameters on every rank).
        optimizer: its optimizer.
        world_size: ranks of the default process group (1: no all-reduce).

    The buffer lives on the parameters' device; it is all-reduced in the default group
    (NCCL or gloo), or in the gloo side group when the default group is NCCL and the
    parameters are on the CPU (:func:`herald.worker.devices.group_for`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int):
        self.model, self.optimizer, self.world_size = model, optimizer, world_size
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []

    def step(self) -> None:
        """Average the gradients over the ranks (one all-reduce), step, zero the gradients."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.world_size > 1 and params:
            flat = self._flat
            if flat is None or not all(p.grad is not None and p.grad.data_ptr() == v.data_ptr()
                                       for p, v in zip(params, self._views)):
                flat = self._bucket(params)
            dist.all_reduce(flat, group=group_for(flat))   # NOTE [worker devices]
            flat /= self.world_size
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def _bucket(self, params: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self._flat, self._views = flat, []
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p)
            self._views.append(p.grad)
            offset += n
        return flat

    def save(self, folder: str | pathlib.Path) -> pathlib.Path:
        """Write model and optimizer state to ``folder/dense.pt`` (atomically); returns the path."""
        out = pathlib.Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "dense.pt.tmp"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, tmp)
        tmp.replace(out / "dense.pt")
        return out / "dense.pt"

    def load(self, folder: str | pathlib.Path, device: torch.device) -> None:
        """Load the state :meth:`save` wrote into ``folder``."""
        state = torch.load(pathlib.Path(folder) / "dense.pt", weights_only=True, map_location=device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
