"""Independent training groups: ``--groups G --consistency hybrid`` runs one dispatcher per
group (NOTE [independent groups] in herald/job/group_dispatch.py) and the leaders drain
their EASGD rounds at the end (NOTE [training groups] in herald/worker/groups.py)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from herald.contracts.microbatch import SAMPLE_ID_RANK_SHIFT
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job import group_dispatch
from herald.job.data import JobData
from herald.job.group_dispatch import (
    GroupBatches,
    SharedBatches,
    group_config,
    independent_groups,
)
from herald.job.launcher import run_train
from herald.job.report.metrics import log_loss
from herald.worker.groups import GroupAverager, GroupLayout, world_position
from tests.fakes import thread_all_reduce

pytestmark = pytest.mark.integration

WORKERS, GROUPS, BATCH, STEPS = 4, 2, 16, 60


def _cfg(tmp_path, data_dir, **kw) -> TrainConfig:
    base = {
        "source": str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"),
        "schedule": "herald",
        "workers": WORKERS,
        "batch_size": BATCH,
        "cache_rows": 1500,
        "embedding_dim": 4,
        "optimizer": "adagrad",
        "lr": 0.01,
        "dense_optimizer": "sgd",
        "dense_lr": 0.05,
        "model": "dlrm",
        "steps": STEPS,
        "eval_fraction": 0.0,
        "seed": 3,
        "run_dir": str(tmp_path),
        "timeout_ms": 60_000,
        "consistency": "hybrid",
        "groups": GROUPS,
        "average_every": 3,
        "easgd_alpha": 0.5,
    }
    return TrainConfig.from_flags(**{**base, **kw})


# ------------------------------------------------------------------ units
def test_shared_batches_hand_each_batch_to_one_group():
    shared = SharedBatches(iter(range(7)))
    views = [GroupBatches(shared, g, batch_rows=4) for g in range(2)]
    got = [next(views[0]), next(views[1]), next(views[1]), *views[0]]
    assert got == list(range(7)) and next(views[1], None) is None
    assert views[0].taken == [0, 3, 4, 5, 6] and views[1].taken == [1, 2]
    ids = views[1].sample_ids(1)  # the view's second batch: stream batch 2, samples 8..11
    assert (ids >> np.uint64(SAMPLE_ID_RANK_SHIFT)).tolist() == [1] * 4
    assert (ids & np.uint64((1 << SAMPLE_ID_RANK_SHIFT) - 1)).tolist() == [8, 9, 10, 11]


def test_world_position():
    assert world_position(-1, 2, 3, 4) == (3, 4)
    assert world_position(1, 2, 1, 2) == (3, 4)
    with pytest.raises(ConfigError, match="group's dispatcher"):
        world_position(2, 2, 0, 2)


def test_only_hybrid_groups_get_dispatchers_and_unsupported_options_are_refused(tmp_path, data_dir):
    assert independent_groups(_cfg(tmp_path, data_dir))
    assert not independent_groups(_cfg(tmp_path, data_dir, consistency="bsp"))
    assert not independent_groups(_cfg(tmp_path, data_dir, groups=1))
    with pytest.raises(ConfigError, match="--checkpoint-every"):
        independent_groups(_cfg(tmp_path, data_dir, checkpoint_every=10))


def test_leaders_with_uneven_rounds_drain_until_all_finished():
    """Leader 0 runs 1 round, leader 1 runs 3: leader 0 drains (finished flag raised) through
    leader 1's last two rounds and one more that both flag; both threads end."""
    reduce = thread_all_reduce(2)  # tests/fakes.py
    lay = GroupLayout(4, 2)
    avgs = [GroupAverager(lay, g, torch.zeros(3), 0.5, reduce, drain=True) for g in range(2)]
    avgs[0].submit(3, torch.ones(3))
    for step in (3, 6, 9):
        avgs[1].submit(step, torch.full((3,), -1.0))
    closers = [threading.Thread(target=lambda g=g: avgs[g].close(20.0)) for g in range(2)]
    for t in closers:  # each leader closes in its own process in a job: here, at the same time
        t.start()
    for t in closers:
        t.join(30)
    assert [a.ended for a in avgs] == [True, True], "a leader's drain did not end"
    assert [a.rounds for a in avgs] == [1, 3]
    assert [a.rounds + a.drain_rounds for a in avgs] == [4, 4]
    assert torch.equal(avgs[0].center, avgs[1].center)


def test_the_groups_stream_holds_exactly_the_samples_g1_trains(tmp_path, data_dir):
    """--steps 5 with 2 groups: 10 group batches of k x BATCH whose samples, in stream order,
    are G = 1's 5 global batches of W x BATCH (labels, dense features and ids)."""
    cfg = _cfg(tmp_path, data_dir, steps=5)
    one, grp = JobData(cfg.with_flags(groups=1)), JobData(group_config(cfg))
    try:
        a, b = list(one.batches), list(grp.batches)
    finally:
        one.close()
        grp.close()
    assert len(a) == 5 and len(b) == 10 and {len(x) for x in b} == {(WORKERS // GROUPS) * BATCH}
    np.testing.assert_array_equal(np.concatenate([x.labels for x in a]), np.concatenate([x.labels for x in b]))
    np.testing.assert_array_equal(np.concatenate([x.dense for x in a]), np.concatenate([x.dense for x in b]))
    for t in range(len(a[0].values)):
        np.testing.assert_array_equal(
            np.concatenate([x.values[t] for x in a]), np.concatenate([x.values[t] for x in b])
        )


# ------------------------------------------------------------------ a real job
def _sample_positions(run_dir):
    ids = np.fromfile(run_dir / "trained_sample_ids.u64", dtype=np.uint64)
    groups = (ids >> np.uint64(SAMPLE_ID_RANK_SHIFT)).astype(np.int64)
    pos = (ids & np.uint64((1 << SAMPLE_ID_RANK_SHIFT) - 1)).astype(np.int64)
    return [pos[groups == g] for g in range(GROUPS)], groups


def _progressive_logloss(records):
    """Log loss of the predictions made before each step's update over ``records``."""
    return log_loss(np.concatenate([r.labels for r in records]), np.concatenate([r.probs for r in records]))


def test_two_groups_train_their_own_data_and_a_straggler_slows_only_its_group(tmp_path, data_dir, monkeypatch):
    """4 workers, 2 groups, rank 1 (group 0) sleeps 150 ms a step. The job trains (loss
    finite, each group's going down); each group's dispatcher took its own batches of the
    shared stream (sample positions disjoint, together every sample of STEPS rounds = what
    G = 1 trains with --steps STEPS); group 1, not slowed, trained more steps than group 0;
    the leaders ran one EASGD round per ``average_every`` steps of their own group and the
    slow group's leader drained the fast one's extra rounds.

    Only what the mechanism guarantees under any scheduling is asserted (a loaded machine
    changes how many batches each group takes, never these relations). In particular the
    job's ``final_loss`` (mean of the last 10 acks) is not compared with its progressive
    log loss: when the stream runs dry the slow group still holds batches in flight
    and trains them at 150 ms a step, so the last acks are mostly its least-trained
    replica's, while the progressive log loss is mostly the fast group's."""
    kept, merge = {}, group_dispatch.merge_records

    def keep(records):  # each group's step records, in its own step order
        kept["per_group"] = records
        return merge(records)

    monkeypatch.setattr(group_dispatch, "merge_records", keep)
    rep = run_train(_cfg(tmp_path, data_dir, slow_worker="1:150", log_sample_ids=True), progress=False)
    per = rep["group_streams"]["groups"]
    total_batches = STEPS * GROUPS  # group batches of k * BATCH samples
    rows = (WORKERS // GROUPS) * BATCH
    assert [p["group"] for p in per] == [0, 1]
    assert sum(p["steps"] for p in per) == total_batches == rep["steps"]
    assert rep["samples"] == STEPS * WORKERS * BATCH
    # nobody waits for the straggler: the groups are not in lockstep (that would be 60 / 60)
    assert per[1]["steps"] > per[0]["steps"], per  # the straggler's group took fewer batches
    positions, groups = _sample_positions(tmp_path)
    assert set(groups.tolist()) == {0, 1}
    assert not set(positions[0].tolist()) & set(positions[1].tolist()), "a sample was trained by both groups"
    union = np.sort(np.concatenate(positions))
    np.testing.assert_array_equal(union, np.arange(STEPS * WORKERS * BATCH))
    assert [len(p) for p in positions] == [per[0]["steps"] * rows, per[1]["steps"] * rows]
    # the job trains: below chance overall, and each group's replica (the straggler's
    # included, pulled by the EASGD corrections) predicts better in its second half of steps
    whole = rep["progressive_validation"]["logloss"]
    assert math.isfinite(rep["final_loss"]) and whole < 0.693, (rep["final_loss"], whole)
    by_group = kept["per_group"]
    assert [len(r) for r in by_group] == [p["steps"] for p in per]
    assert [p["final_loss"] for p in per] == [float(np.mean([r.loss for r in recs[-10:]])) for recs in by_group]
    for g, recs in enumerate(by_group):
        first, second = _progressive_logloss(recs[: len(recs) // 2]), _progressive_logloss(recs[len(recs) // 2 :])
        assert second < first, (g, first, second)
    assert rep["consistency"]["mode"] == "hybrid" and rep["consistency"]["gradient_rows_pushed"] > 0
    leaders = rep["groups"]["leaders"]
    every = rep["groups"]["average_every"]
    assert [s["group"] for s in leaders] == [0, 1] and all(s["thread_ended"] for s in leaders)
    # NOTE [training groups]: a leader submits one round every `every` steps of its own group
    assert [s["rounds"] for s in leaders] == [p["steps"] // every for p in per], (leaders, per)
    # every round is one collective of both leaders: the slow group's leader drained the fast
    # one's extra rounds, then both ran one last round flagged finished by both
    assert leaders[0]["drain_rounds"] == leaders[1]["rounds"] - leaders[0]["rounds"] + 1 > 1
    assert leaders[1]["drain_rounds"] == 1
    text = (tmp_path / "report.txt").read_text()
    assert "one dispatcher per group" in text and f"final train loss {per[1]['final_loss']:.4f}" in text
