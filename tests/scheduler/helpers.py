"""Random SampleBatches and a driver that runs the scheduler over them (tests only)."""

from __future__ import annotations

import numpy as np

from herald.loader.batch import SampleBatch
from herald.scheduler import Scheduler, SchedulerConfig


def random_batches(seed, num_steps, global_batch, num_tables, vocab=12, max_len=3, single_hot=False):
    """Batches with multi-hot tables (repeats allowed) and ids spread over all 64 bits."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**64 - 1, size=vocab, dtype=np.uint64, endpoint=True)
    pool[0] = np.uint64(2**64 - 1)
    pool[1] = np.uint64(2**63)
    out = []
    for _ in range(num_steps):
        values, offsets = [], []
        for _t in range(num_tables):
            lens = np.ones(global_batch, np.int64) if single_hot else rng.integers(0, max_len + 1, global_batch)
            off = np.zeros(global_batch + 1, np.int64)
            np.cumsum(lens, out=off[1:])
            # skewed popularity so that keys repeat across steps and workers
            idx = np.minimum(rng.geometric(0.25, size=int(off[-1])) - 1, vocab - 1)
            values.append(pool[idx])
            offsets.append(off)
        out.append(
            SampleBatch(np.zeros(global_batch, np.float32), np.zeros((global_batch, 0), np.float32), values, offsets)
        )
    return out


def run_scheduler(batches, cfg: SchedulerConfig, num_tables, **kw):
    """All StepPlans of a run, in step order, and the scheduler (after finish)."""
    sched = Scheduler(cfg, num_tables, **kw)
    plans = []
    for b in batches:
        p = sched.submit(b)
        if p is not None:
            plans.append(p)
    last = sched.finish()
    if last is not None:
        plans.append(last)
    return plans, sched


def keylist(ks):
    return list(zip(ks.table.tolist(), ks.ids.tolist()))
