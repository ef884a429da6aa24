"""The keys a step touches and the pulls of the next step that may start early.

NOTE [early pulls]: during step t the PS copy of a key changes only if some worker
pushes its gradient (grad_push), plan-pushes it (plan_push) or writes it back on
eviction at step t. Every other key's PS copy is already final for step t + 1 once
every worker has finished step t - 1 (whose all-reduce orders every push of t - 1
before any step-t work). So each micro-batch of step t + 1 carries ``pull_early``
(computed in step order by the build thread):
True for the pulls whose key is not touched at step t (by any worker). A worker may
fetch those while it computes step t (it has passed step t - 1's all-reduce when it
receives micro-batch t + 1) and the rest after step t's all-reduce, and still read
exactly what the serial protocol reads. A key a worker writes back at step t + 1 is
never pulled by another worker at t + 1 (that worker held the only latest copy, and
Herald Alg. 2 would have plan-pushed it at step t), so write-backs may finish any time
before the writer's all-reduce of step t + 1. Touched keys are compared by a 64-bit
hash of (table, id): a collision can only mark a pull "wait", never "early".

Only modes whose workers read early compute the marks
(:attr:`herald.contracts.consistency.ModeSettings.reads_early`: bounded with s > 0): under bsp and
bounded at staleness 0 every pull of step t + 1 rides on step t's messages (NOTE [step
messages] in herald/ps/stepped.py), and hybrid pulls every row unordered, so the marks
would go unread (about 0.2 ms per step of the build thread at 2 workers x 256).

Implemented with two kernels of :mod:`herald.dispatch.kernels`: a hash set of the
touched keys' 64-bit hashes ``id ^ (table * KEY_MIX)`` and a membership test per pull.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from herald.contracts.plan import KeySet
from herald.dispatch.kernels import KEY_MIX, not_touched_jit, touched_set_jit


@dataclasses.dataclass(frozen=True)
class TouchedKeys:
    """Hashes of the keys whose PS copy one step's plans change (grad push, plan push,
    write-back on eviction), over all workers: an open-addressing set (``slots`` uint64
    [power of two], 0 empty) and whether hash 0 is in it."""

    slots: np.ndarray
    has_zero: np.ndarray

    def __len__(self) -> int:
        return int(np.count_nonzero(self.slots)) + int(self.has_zero[0])


def key_hash(keys: KeySet) -> np.ndarray:
    """uint64 [n]: ``id ^ (table * KEY_MIX)``; equal keys hash equal (NOTE [early pulls])."""
    return keys.ids ^ (keys.table.astype(np.uint64) * KEY_MIX)


def touched_keys(plans: list) -> TouchedKeys:
    """The :class:`TouchedKeys` of one step's plans (one :class:`CachePlan` per worker)."""
    pushed = [ks for p in plans for ks in (p.grad_push, p.plan_push)]
    evict = [p.evict for p in plans]
    table = _concat([ks.table for ks in pushed] + [ks.table for ks in evict], np.int32)
    ids = _concat([ks.ids for ks in pushed] + [ks.ids for ks in evict], np.uint64)
    n_pushed = sum(len(ks) for ks in pushed)
    keep = np.ones(ids.shape[0], np.bool_)
    if evict:
        keep[n_pushed:] = _concat([p.write_back for p in plans], np.bool_)
    size = 1 << max(4, int(2 * np.count_nonzero(keep)).bit_length())  # load factor <= 1/2
    slots = np.zeros(size, np.uint64)
    has_zero = np.zeros(1, np.bool_)
    touched_set_jit(table, ids, keep, slots, has_zero)
    return TouchedKeys(slots, has_zero)


def _concat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def early_pulls(pull: KeySet, touched_before: TouchedKeys | None) -> np.ndarray:
    """bool [len(pull)]: pulls whose key the previous step does not touch (all False when
    the previous step is unknown)."""
    out = np.zeros(len(pull), np.bool_)
    if touched_before is not None and len(pull):
        not_touched_jit(
            np.ascontiguousarray(pull.table, np.int32), pull.ids, touched_before.slots, touched_before.has_zero, out
        )
    return out
