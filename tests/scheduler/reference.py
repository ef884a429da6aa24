"""An obviously-correct pure-Python model of the scheduler (dicts and sets), for tests.

It follows docs/design.md, "Consistency protocol" and NOTE [step protocol]
literally, one key at a time. The only shared conventions with the kernels are
written here once:

- canonical key order of worker w: its samples in ascending index order, each sample's
  tables in order, each table's values in order; first occurrence counts;
- the cache policy order: every touch (hit or stale copy, in canonical order) and
  every insert (miss, in canonical order, after the evictions) takes the next value of
  a per-worker sequence; LRU evicts the smallest sequence, LFU the smallest
  (count, sequence) where count = steps used since insertion; victims are never keys
  of K_w; victims are evicted in that order;
- plan pushes: the next step's keys in worker order then canonical order; a key held
  dirty by o and used by w != o is pushed by o at its first such occurrence;
- RNG: splitmix64; random partition = Fisher-Yates; LAIA = one draw per sample to pick
  among the available workers with the best score, in worker order.
"""

from __future__ import annotations

from collections import defaultdict

M64 = (1 << 64) - 1
CAUSES = ("hit", "miss_pull", "update_pull", "grad_push", "plan_push", "evict_push")


class RefRng:
    def __init__(self, seed: int) -> None:
        self.s = seed

    def next(self) -> int:
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)


def sample_keys(batch, i):
    """Keys (table, id) of sample i, tables in order, values in order (with repeats)."""
    out = []
    for t in range(batch.num_tables):
        o = batch.offsets[t]
        out.extend((t, int(v)) for v in batch.values[t][o[i] : o[i + 1]])
    return out


class RefScheduler:
    def __init__(self, W, per_worker, cap, policy, full_sync, allocation, seed, tables_on=None):
        self.W, self.per, self.cap, self.policy = W, per_worker, cap, policy
        self.full_sync, self.allocation = full_sync, allocation
        self.rng = RefRng(seed)
        self.tables_on = tables_on
        self.cache = [dict() for _ in range(W)]  # key -> [count, seq]
        self.seq = [0] * W
        self.valid = [set() for _ in range(W)]
        self.owner = {}  # key -> worker holding the only latest copy
        self.pending = None
        self.done = []  # finished steps: dicts

    # -- allocation
    def allocate(self, batch, external=None):
        n = len(batch)
        if self.allocation == "random":
            perm = list(range(n))
            for i in range(n - 1, 0, -1):
                j = self.rng.next() % (i + 1)
                perm[i], perm[j] = perm[j], perm[i]
            worker_of = [0] * n
            for k in range(n):
                worker_of[perm[k]] = k // self.per
            return worker_of
        if self.allocation == "laia":
            load = [0] * self.W
            worker_of = []
            for i in range(n):
                ks = {k for k in sample_keys(batch, i) if self.tables_on is None or k[0] in self.tables_on}
                score = [sum(1 for k in ks if k in self.valid[w]) for w in range(self.W)]
                avail = [w for w in range(self.W) if load[w] < self.per]
                best = max(score[w] for w in avail)
                ties = [w for w in avail if score[w] == best]
                w = ties[self.rng.next() % len(ties)]
                worker_of.append(w)
                load[w] += 1
            return worker_of
        return list(external)

    def prio(self, w, k):
        c, s = self.cache[w][k]
        return s if self.policy == "lru" else (c, s)

    def touch(self, w, k, new):
        self.seq[w] += 1
        if new:
            self.cache[w][k] = [1, self.seq[w]]
        else:
            self.cache[w][k][0] += 1
            self.cache[w][k][1] = self.seq[w]

    # -- one step
    def submit(self, batch, external=None):
        worker_of = self.allocate(batch, external)
        Kw = [[] for _ in range(self.W)]
        for w in range(self.W):
            seen = set()
            for i in sorted(i for i in range(len(batch)) if worker_of[i] == w):
                for k in sample_keys(batch, i):
                    if k not in seen:
                        seen.add(k)
                        Kw[w].append(k)
        if self.pending is not None:
            pp = [[] for _ in range(self.W)]
            if not self.full_sync:
                for w in range(self.W):
                    for k in Kw[w]:
                        o = self.owner.get(k)
                        if o is not None and o != w:
                            pp[o].append(k)
                            del self.owner[k]
            self.finalize(pp)
        rec = {
            "worker_of": worker_of,
            "counts": [dict.fromkeys(CAUSES, 0) for _ in range(self.W)],
            "evict": [],
            "write_back": [],
            "pull": [],
            "grad_push": [],
            "contributors": [],
            "update_local": [],
        }
        for w in range(self.W):
            c = rec["counts"][w]
            kset = set(Kw[w])
            if len(kset) > self.cap:
                raise OverflowError(w)
            misses = 0
            for k in Kw[w]:
                if k in self.cache[w]:
                    c["hit" if k in self.valid[w] else "update_pull"] += 1
                else:
                    misses += 1
            c["miss_pull"] = misses
            for k in Kw[w]:
                if k in self.cache[w]:
                    self.touch(w, k, False)
            need = len(self.cache[w]) + misses - self.cap
            victims = sorted((k for k in self.cache[w] if k not in kset), key=lambda k: self.prio(w, k))
            ev, wb = [], []
            for k in victims[: max(need, 0)]:
                del self.cache[w][k]
                self.valid[w].discard(k)
                flag = self.owner.get(k) == w
                if flag:
                    del self.owner[k]
                    c["evict_push"] += 1
                ev.append(k)
                wb.append(flag)
            pulls = []
            for k in Kw[w]:
                if k not in self.valid[w]:
                    if k in self.owner:
                        raise AssertionError(f"pull of {k} while worker {self.owner[k]} holds the only latest copy")
                    if k not in self.cache[w]:
                        self.touch(w, k, True)
                    self.valid[w].add(k)
                    pulls.append(k)
            rec["evict"].append(ev)
            rec["write_back"].append(wb)
            rec["pull"].append(pulls)
        users = defaultdict(set)
        for w in range(self.W):
            for k in Kw[w]:
                users[k].add(w)
        for w in range(self.W):
            gp = [k for k in Kw[w] if len(users[k]) >= 2 or self.full_sync]
            rec["grad_push"].append(gp)
            rec["contributors"].append([len(users[k]) for k in gp])
            rec["update_local"].append([k for k in Kw[w] if len(users[k]) == 1])
            rec["counts"][w]["grad_push"] = len(gp)
        for k, U in users.items():
            for v in range(self.W):
                self.valid[v].discard(k)
            self.owner.pop(k, None)
            if len(U) == 1:
                (w,) = U
                self.valid[w].add(k)
                if not self.full_sync:
                    self.owner[k] = w
        self.pending = rec

    def finalize(self, pp):
        rec = self.pending
        rec["plan_push"] = pp
        for w in range(self.W):
            rec["counts"][w]["plan_push"] = len(pp[w])
        self.done.append(rec)
        self.pending = None

    def finish(self):
        if self.pending is not None:
            self.finalize([[] for _ in range(self.W)])

    def dirty(self):
        out = [set() for _ in range(self.W)]
        for k, w in self.owner.items():
            out[w].add(k)
        return out
