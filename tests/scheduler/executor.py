"""Executes StepPlans like workers and a PS would (NOTE [step protocol]) with version
numbers instead of rows, checking the protocol's invariants at every action."""

from __future__ import annotations

from collections import defaultdict

from .helpers import keylist
from .reference import sample_keys


def execute(batches, plans, cap, W):
    """Replay ``plans`` over ``batches``; returns (worker caches, PS versions, latest versions)."""
    latest = defaultdict(int)
    ps = defaultdict(int)
    cache = [dict() for _ in range(W)]
    keys_next = None
    for b, p in zip(batches, plans):
        Kw = []
        for w in range(W):
            ks = []
            for i in p.assignment[w]:
                ks.extend(sample_keys(b, int(i)))
            Kw.append(ks)
        users = defaultdict(set)
        for w in range(W):
            for k in Kw[w]:
                users[k].add(w)
        for w, cp in enumerate(p.plans):
            for k, wb in zip(keylist(cp.evict), cp.write_back.tolist()):
                assert k in cache[w], f"evict of uncached {k}"
                only_latest = (
                    cache[w][k] == latest[k]
                    and ps[k] != latest[k]
                    and not any(cache[v].get(k) == latest[k] for v in range(W) if v != w)
                )
                assert wb == only_latest, f"write_back flag wrong for {k}"
                if wb:
                    ps[k] = cache[w][k]
                assert k not in users or w not in users[k], "evicted a key the worker uses this step"
                del cache[w][k]
            for k in keylist(cp.pull):
                assert ps[k] == latest[k], f"pull of {k} while the PS copy is not latest"
                cache[w][k] = ps[k]
            assert len(cache[w]) <= cap, "cache over capacity"
            for k in Kw[w]:
                assert cache[w].get(k) == latest[k], f"worker {w} trains {k} on a stale or missing copy"
        applied = defaultdict(int)
        contrib = defaultdict(int)
        for w, cp in enumerate(p.plans):
            for k, c in zip(keylist(cp.grad_push), cp.contributors.tolist()):
                assert c == len(users[k])
                assert w in users[k]
                contrib[k] += 1
        for k, n in contrib.items():
            assert n == len(users[k]), "PS must get every user's gradient"
            latest[k] += 1
            ps[k] = latest[k]
            applied[k] += 1
        for w, cp in enumerate(p.plans):
            for k in keylist(cp.update_local):
                assert users[k] == {w}
                if k not in contrib:
                    latest[k] += 1
                    applied[k] += 1
                cache[w][k] = latest[k]
        for k in users:
            assert applied[k] == 1, f"{k} got {applied[k]} optimizer applications in one step"
        for w, cp in enumerate(p.plans):
            for k in keylist(cp.plan_push):
                assert cache[w].get(k) == latest[k] and ps[k] != latest[k], "plan push of a non-dirty key"
                ps[k] = latest[k]
        keys_next = Kw
    del keys_next
    return cache, ps, latest
