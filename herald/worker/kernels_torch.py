"""The sparse optimizers as torch operations, for the device-resident cache.

The same arithmetic as the PS's numba kernel :func:`herald.ps.kernels.apply_row_jit`
(float32 throughout, hyper-parameters rounded to float32 as the kernel's ``hp`` array
holds them; Adam's bias corrections in float64, then rounded to float32), written as
whole-tensor operations so they run on any device: the same IEEE operations in the
same order, element by element. Two details keep them so:

- square roots are taken in float64 and rounded to float32 (correctly rounded, as the
  numba kernel's ``sqrt``; torch's vectorised float32 ``sqrt`` on the CPU is not);
- the row-wise Adagrad's sum of squares is added column by column, left to right, as
  the kernel's loop does (a tree reduction rounds differently).

On the CPU the results are bit-identical to the numba kernels on every case the
tests draw; ``pow`` in float64 (Adam) may differ by one float64 ulp between libraries,
so the contract is agreement within 1e-6 (tests/worker/test_device_cache.py).
"""

from __future__ import annotations

import numpy as np
import torch

from herald.contracts.tables import TableConfig

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3


def _f32(x: float) -> float:
    """``x`` rounded to float32 (a Python float that converts to float32 exactly)."""
    return float(np.float32(x))


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (via float64; double rounding is exact here)."""
    return torch.sqrt(x.double()).float()


def _row_sum_sq(g: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1]: ``sum_j g[:, j]^2``, added left to right (the kernel's order)."""
    sq = g * g
    acc = torch.zeros_like(sq[:, :1])
    for j in range(sq.shape[1]):
        acc = acc + sq[:, j : j + 1]
    return acc


def apply_rows_torch(rows: torch.Tensor, grads: torch.Tensor, table: TableConfig) -> torch.Tensor:
    """One sparse-optimizer step on gathered rows (Persia §4.2.2: the state lives in the row).

    Args:
        rows: float32 [n, row_width] (embedding, then optimizer state; the layout of
            :mod:`herald.ps.config`), on any device; not modified.
        grads: float32 [n, dim], the summed gradient of each row, on the same device.
        table: the table (optimizer kind, dim, hyper-parameters).

    Returns:
        float32 [n, row_width]: the updated rows (a new tensor).

    Raises:
        ValueError: shapes, dtypes or devices that do not match the table.
    """
    dim, width = table.dim, table.row_width
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != width:
        raise ValueError(f"rows must be float32 [n, {width}], got {rows.dtype} {tuple(rows.shape)}")
    if grads.dtype != torch.float32 or tuple(grads.shape) != (rows.shape[0], dim) or grads.device != rows.device:
        raise ValueError(
            f"grads must be float32 [{rows.shape[0]}, {dim}] on {rows.device}, "
            f"got {grads.dtype} {tuple(grads.shape)} on {grads.device}"
        )
    opt = table.optimizer
    lr, eps, wd = _f32(opt.lr), _f32(opt.eps), _f32(opt.weight_decay)
    w = rows[:, :dim]
    g = grads if wd == 0 else grads + wd * w
    out = torch.empty_like(rows)
    kind = opt.kind
    if kind == SGD:
        out[:, :dim] = w - lr * g
    elif kind == ADAGRAD:
        s = rows[:, dim:] + g * g
        out[:, dim:] = s
        out[:, :dim] = w - lr * g / (_sqrt(s) + eps)
    elif kind == ROWWISE_ADAGRAD:
        s = rows[:, dim : dim + 1] + _row_sum_sq(g) / _f32(dim)
        out[:, dim:] = s
        out[:, :dim] = w - lr * g / (_sqrt(s) + eps)
    elif kind == ADAM:
        out[:, :] = _adam(rows, g, dim, lr, eps, _f32(opt.beta1), _f32(opt.beta2))
    else:
        raise ValueError(f"unknown optimizer kind {kind}")
    return out


def _adam(rows: torch.Tensor, g: torch.Tensor, dim: int, lr: float, eps: float, b1: float, b2: float) -> torch.Tensor:
    """Adam with a per-row step count stored at ``rows[:, 3 * dim]`` (torch.optim.Adam's formula)."""
    w, m, v = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
    t = rows[:, 3 * dim : 3 * dim + 1] + 1.0
    t64 = t.double()
    bc1 = 1.0 - torch.pow(torch.tensor(b1, dtype=torch.float64, device=rows.device), t64)
    bc2 = 1.0 - torch.pow(torch.tensor(b2, dtype=torch.float64, device=rows.device), t64)
    step_size = (lr / bc1).float()
    bc2_sqrt = torch.sqrt(bc2).float()
    one_b1, one_b2 = _f32(np.float32(1) - np.float32(b1)), _f32(np.float32(1) - np.float32(b2))
    m = m + one_b1 * (g - m)
    v = v * b2 + one_b2 * g * g
    w = w - step_size * m / (_sqrt(v) / bc2_sqrt + eps)
    return torch.cat([w, m, v, t], dim=1)
