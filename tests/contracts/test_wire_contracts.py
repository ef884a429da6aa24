"""The contracts the dispatcher and the worker share (the cache plan, the micro-batch's
layout and codec) load nothing heavy: a worker decodes a micro-batch, and the scheduler
plans, without importing the other role (docs/design.md, "Layers")."""

import subprocess
import sys

import numpy as np

from herald import wire
from herald.contracts.microbatch import MicroBatch, make_sample_ids
from herald.contracts.plan import CachePlan, KeySet


def test_the_plan_and_the_microbatch_load_no_numba_torch_zmq_or_dispatcher():
    code = (
        "import sys, herald.contracts.plan, herald.contracts.microbatch; "
        "heavy = {'torch', 'numba', 'zmq', 'herald.dispatch', 'herald.worker', 'herald.scheduler'}; "
        "loaded = heavy & set(sys.modules); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_microbatch_made_without_the_builder_round_trips():
    """The codec alone (no numba builder): one table, two samples with ids 7 and 9, 9."""
    keys = KeySet(np.array([0], np.int32), np.array([9], np.uint64))
    plan = CachePlan(
        KeySet.empty(), np.zeros(0, bool), keys, keys, np.array([1], np.uint16), KeySet.empty(), KeySet.empty()
    )
    mb = MicroBatch(
        3,
        1,
        make_sample_ids(2, 10, 2),
        np.array([1, 0], np.float32),
        np.zeros((2, 1), np.float32),
        np.array([7, 9], np.uint64),
        np.array([0, 2], np.int64),
        np.array([0, 1, 1], np.uint16),
        np.array([[0, 1, 3]], np.int64),
        plan,
    )
    back = MicroBatch.from_frames(*wire.unpack([bytes(memoryview(f)) for f in wire.pack(*mb.to_frames())]))
    assert (back.step, back.rank, len(back)) == (3, 1, 2)
    assert back.values(0).tolist() == [7, 9, 9]
    assert back.sample_ids.tolist() == [(2 << 56) | 10, (2 << 56) | 11]
    assert back.plan.pull.as_set() == {(0, 9)} and back.pull_early.tolist() == [False]
