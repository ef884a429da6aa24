"""Atomic read-modify-write of one array element, for the parallel scheduler kernels.

The per-key masks (``cached``, ``valid``, ``use_mask``: one bit per worker in one
uint64, :mod:`herald.scheduler.state`) are shared by the threads of the parallel passes
(Herald §4.4, "Multi-threading"): a thread working for worker ``w`` changes only bit
``w``, but a plain ``m[s] |= bit`` of two threads on the same key can lose one of the
updates. These intrinsics compile to one LLVM ``atomicrmw`` (``lock or`` / ``lock and``
/ ``lock xadd`` on x86) with monotonic (relaxed) ordering: each update is indivisible;
the phases of a step are ordered by the end of each parallel loop, not by these.

They return the element's previous value, so ``atomic_or_jit(m, s, bit) & bit == 0``
also tells the caller it set the bit first (a per-worker dedup without scratch marks).
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _atomic_rmw(op: str):
    def typer(typingctx, arr, idx, val):
        if (
            not isinstance(arr, types.Array)
            or arr.ndim != 1
            or not isinstance(arr.dtype, types.Integer)
            or not isinstance(idx, types.Integer)
            or not isinstance(val, types.Integer)
        ):
            return None

        def codegen(context, builder, signature, args):
            aryty, idxty, valty = signature.args
            ary = context.make_array(aryty)(context, builder, args[0])
            i = context.cast(builder, args[1], idxty, types.intp)
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [i], wraparound=False)
            v = context.cast(builder, args[2], valty, aryty.dtype)
            return builder.atomic_rmw(op, ptr, v, "monotonic")

        return arr.dtype(arr, idx, val), codegen

    return typer


@intrinsic
def atomic_or_jit(typingctx, arr, idx, val):
    """``old = arr[idx]; arr[idx] = old | val`` as one atomic step; returns ``old``.

    ``arr``: 1-d integer array of any layout (e.g. a strided view of the key records);
    ``idx``, ``val``: integers (``val`` cast to the array's dtype)."""
    return _atomic_rmw("or")(typingctx, arr, idx, val)


@intrinsic
def atomic_and_jit(typingctx, arr, idx, val):
    """``old = arr[idx]; arr[idx] = old & val`` as one atomic step; returns ``old``."""
    return _atomic_rmw("and")(typingctx, arr, idx, val)


@intrinsic
def atomic_add_jit(typingctx, arr, idx, val):
    """``old = arr[idx]; arr[idx] = old + val`` as one atomic step (wrapping); returns ``old``."""
    return _atomic_rmw("add")(typingctx, arr, idx, val)
