"""Brute-force step-optimal allocation for tiny cases (Herald App. C).

With one sample per worker, the transmissions caused by an allocation of step t+1
(step t's plan pushes, then step t+1's pulls, write-backs and gradient pushes)
split exactly into a per-(sample, worker) cost plus a constant:

- pulls: the sample's keys not valid in the worker;
- write-backs: victims of that worker (its cache policy, the sample's keys excluded)
  that it holds dirty and that no sample of the batch uses (a dirty key another worker
  uses is plan-pushed first, so its eviction moves nothing);
- plan pushes: a dirty key used by exactly one sample, placed off its owner (a key used
  by >= 2 samples is pushed whatever the allocation);
- gradient pushes: |U(e)| = samples using e, the same for every allocation.

The search enumerates all ``W!`` assignments (W <= 8: 40,320) of that cost matrix and
keeps the first minimum. Quality of a policy = transmissions of this scheduler /
transmissions of the policy over the same run (Herald App. C reports 0.45-0.57).
"""

from __future__ import annotations

import itertools

import numpy as np

_PERMS: dict[int, np.ndarray] = {}


def _perms(W: int) -> np.ndarray:
    if W not in _PERMS:
        _PERMS[W] = np.array(list(itertools.permutations(range(W))), np.int64)
    return _PERMS[W]


def _victims(snaps, w: int, need: int, exclude: set) -> list:
    """The ``need`` victims worker ``w`` would evict with ``exclude`` (its keys) kept."""
    if need <= 0:
        return []
    out = []
    if snaps.policy == "lru":
        for i in range(int(snaps.head[w]), int(snaps.tail[w])):
            s = int(snaps.log[w, i])
            if s >= 0 and int(snaps.pos[s, w]) == i and s not in exclude:  # -1: stale entry
                out.append(s)
                if len(out) == need:
                    break
        return out
    size = int(snaps.size[w])
    slots = snaps.hslot[w, :size]
    prio = snaps.hprio[w, :size]
    order = np.argsort(prio, kind="stable")
    for j in order:
        s = int(slots[j])
        if s not in exclude:
            out.append(s)
            if len(out) == need:
                break
    return out


def cost_matrix(snaps, samp_off, samp_slot, num_workers: int) -> np.ndarray:
    """float64 [B, W]: allocation-dependent transmissions of placing sample s on worker w."""
    B = samp_off.shape[0] - 1
    W = num_workers
    keys = [set(samp_slot[samp_off[i] : samp_off[i + 1]].tolist()) for i in range(B)]
    m: dict[int, int] = {}
    for ks in keys:
        for s in ks:
            m[s] = m.get(s, 0) + 1
    cost = np.zeros((B, W), np.float64)
    for i, ks in enumerate(keys):
        for w in range(W):
            bit = np.uint64(1) << np.uint64(w)
            c = 0
            miss = 0
            for s in ks:
                if not (snaps.valid[s] & bit):
                    c += 1
                    if not (snaps.cached[s] & bit):
                        miss += 1
                o = int(snaps.owner[s])
                if o >= 0 and o != w and m[s] == 1:
                    c += 1
            need = int(snaps.size[w]) + miss - snaps.capacity_rows
            for v in _victims(snaps, w, need, ks):
                if int(snaps.owner[v]) == w and v not in m:
                    c += 1
            cost[i, w] = c
    return cost


def bruteforce_alloc(snaps, samp_off, samp_slot, num_workers: int, out_worker: np.ndarray) -> None:
    """Write into ``out_worker`` int32 [W] the step-optimal one-sample-per-worker allocation."""
    cost = cost_matrix(snaps, samp_off, samp_slot, num_workers)
    perms = _perms(num_workers)  # perms[p, w] = sample on worker w
    total = cost[perms, np.arange(num_workers)].sum(axis=1)
    best = perms[int(np.argmin(total))]
    out_worker[best] = np.arange(num_workers, dtype=np.int32)
