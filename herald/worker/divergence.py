"""Stopping a job whose training diverged: a non-finite loss or gradient, caught on the
worker before anything of the step is pushed or all-reduced (docs/operations.md).

A NaN pushed once spreads to every row and replica it reaches, and training goes on
silently; :func:`check_finite` stops the step first, so the PS rows and the other ranks'
replicas stay clean and the job can continue from its last checkpoint.
"""

from __future__ import annotations

import math

import torch

from herald.contracts.job import JobSpec
from herald.errors import HeraldError


class TrainingDiverged(HeraldError):
    """A worker's loss or gradient turned non-finite (NaN or inf); the message names the
    step, the rank and the likely cause (learning rate too high, or bad input)."""


def check_finite(
    job: JobSpec, rank: int, step: int, loss: torch.Tensor | float | None, grads: list[torch.Tensor | None]
) -> None:
    """Raise if ``loss`` (the micro-batch's mean loss, or None) or any of ``grads`` (the
    embedding rows' and the dense parameters' gradients; None entries are skipped) is not
    finite.

    Raises:
        TrainingDiverged: naming ``step``, ``rank`` and the likely cause (``job``'s learning rates).
    """
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else (None if loss is None else float(loss))
    present = [g for g in grads if g is not None]
    what = None
    if value is not None and not math.isfinite(value):
        what = f"the loss is {value}"
    elif present and not all_finite(present):
        what = "a gradient is not finite" + (f" (loss {value:.4g})" if value is not None else "")
    if what is None:
        return
    lr = job.tables[0].optimizer.lr
    raise TrainingDiverged(
        f"rank {rank}: {what} at step {step}: training diverged. Likely cause: a learning rate too high "
        f"(--lr {lr:g}, --dense-lr {job.dense_lr:g}: lower them) or bad input values (the loader drops "
        "non-finite and out-of-range labels and dense values; look for extreme ones). Nothing of this step "
        "was applied; fix and continue from the last checkpoint with --resume (docs/operations.md)"
    )


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite, in about one reduction per tensor:
    a NaN or inf anywhere makes the sum of sums non-finite; only when it is (also when
    finite values overflow the sum) are the elements checked one by one."""
    if bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum())):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)
