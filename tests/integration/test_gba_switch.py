"""Switching ``--consistency bsp`` <-> ``gba`` at a checkpoint (NOTE [gba checkpoints] in
herald/dispatch/gba.py; GBA §4: GBA keeps the synchronous global batch, so the
switch needs no hyper-parameter change). Real PS shard, dispatcher and worker processes
on loopback, the Criteo sample.

With ``iota = 0`` GBA is exactly BSP (tests/integration/test_gba.py), so a job trained
half under one mode and half under the other must end with the uninterrupted BSP job's
model, within the exactness test's tolerances (tests/integration/test_train_exact.py:
embeddings 1e-5, optimizer state 1e-5 relative, dense parameters 1e-5); a GBA job
resumed under GBA must end with the uninterrupted GBA job's model (1e-6, as
tests/integration/test_resume.py).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch

from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job import checkpoints
from herald.job.launcher import run_train
from herald.ps import PSClient
from tests.integration.test_resume import _ids, _ps_rows

pytestmark = pytest.mark.integration

WORKERS, BATCH, STEPS, EVERY, DIM = 2, 8, 20, 10, 4


def _cfg(data_dir, run_dir, consistency, steps, **settings) -> TrainConfig:
    base = dict(
        source=str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"),
        schedule="herald",
        workers=WORKERS,
        batch_size=BATCH,
        cache_rows=260,
        embedding_dim=DIM,
        optimizer="adagrad",
        lr=0.01,
        dense_optimizer="adam",
        dense_lr=0.01,
        model="dlrm",
        steps=steps,
        eval_fraction=0.0,
        seed=3,
        run_dir=str(run_dir),
        timeout_ms=60_000,
        checkpoint_every=EVERY,
        log_sample_ids=True,
        consistency=consistency,
    )
    base.update(settings)
    return TrainConfig.from_flags(**base)


def _train(data_dir, run_dir, consistency, steps, resume=False, **settings) -> dict:
    seen: dict = {}

    def gba_stats(addresses, job):
        if job.consistency == "gba":
            with PSClient(addresses, tables=list(job.tables), timeout_ms=10_000) as client:
                seen["gba"] = [s["gba"] for s in client.stats()]

    rep = run_train(
        _cfg(data_dir, run_dir, consistency, steps, resume=resume, **settings), progress=False, on_finish=gba_stats
    )
    rep["_gba"] = seen.get("gba")
    return rep


def _meta(run_dir: pathlib.Path, step: int) -> dict:
    return json.loads((run_dir / f"checkpoints/step-{step:08d}/meta.json").read_text())


def _assert_same_model(got: pathlib.Path, want: pathlib.Path, tol: float) -> None:
    """The final checkpoints' PS rows (embeddings within ``tol``, optimizer state within
    ``tol`` relative) and the dense replicas (rank 0 within ``tol``, every rank equal)."""
    final = f"checkpoints/step-{STEPS - 1:08d}"
    a, b = _ps_rows(got / final), _ps_rows(want / final)
    assert a.keys() == b.keys() and a
    for t in a:
        assert np.array_equal(a[t][0], b[t][0]), f"table {t}: the PS holds other keys"
        emb = float(np.abs(a[t][1][:, :DIM] - b[t][1][:, :DIM]).max())
        state = float((np.abs(a[t][1][:, DIM:] - b[t][1][:, DIM:]) / np.maximum(1.0, np.abs(b[t][1][:, DIM:]))).max())
        assert emb <= tol and state <= tol, f"table {t}: embeddings differ by {emb}, optimizer state by {state}"
    da, db = (torch.load(d / "dense-rank0.pt", weights_only=True) for d in (got, want))
    assert da.keys() == db.keys()
    worst = max(float((da[k] - db[k]).abs().max()) for k in da)
    assert worst <= tol, f"dense parameters differ by {worst}"
    for r in range(1, WORKERS):
        other = torch.load(got / f"dense-rank{r}.pt", weights_only=True)
        assert all(torch.equal(other[k], da[k]) for k in da), f"rank {r}'s dense replica diverged"
    assert np.array_equal(_ids(got), _ids(want)), "another sequence of samples was trained"


@pytest.fixture(scope="module")
def whole_bsp(tmp_path_factory, data_dir) -> pathlib.Path:
    """The uninterrupted BSP job: 20 steps, checkpoints at steps 9 and 19."""
    run_dir = tmp_path_factory.mktemp("switch") / "whole-bsp"
    rep = _train(data_dir, run_dir, "bsp", STEPS)
    assert rep["steps"] == STEPS and rep["consistency"]["switched_from"] is None
    return run_dir


@pytest.fixture(scope="module")
def half_gba(tmp_path_factory, data_dir) -> pathlib.Path:
    """A GBA job (iota = 0) stopped after its checkpoint of step 9 (copied before each resume)."""
    run_dir = tmp_path_factory.mktemp("switch") / "half-gba"
    rep = _train(data_dir, run_dir, "gba", EVERY)
    assert rep["steps"] == EVERY
    assert all(s["global_step"] == EVERY and s["pending"] == 0 for s in rep["_gba"])
    meta = _meta(run_dir, EVERY - 1)
    assert meta["consistency"]["mode"] == "gba" and meta["dispatcher"]["next_step"] == EVERY
    assert meta["config"]["lr"] == 0.01 and (run_dir / f"checkpoints/step-{EVERY - 1:08d}/dense.pt").exists()
    return run_dir


def test_bsp_checkpoint_resumed_as_gba_trains_the_bsp_model(tmp_path, data_dir, whole_bsp):
    """(a) BSP to step 9 with a checkpoint, resumed there as GBA iota = 0 to step 19."""
    parts = tmp_path / "bsp-then-gba"
    _train(data_dir, parts, "bsp", EVERY)
    assert _meta(parts, EVERY - 1)["consistency"]["mode"] == "bsp"
    rep = _train(data_dir, parts, "gba", STEPS, resume=True)
    assert rep["steps"] == STEPS - EVERY and rep["consistency"]["switched_from"] == "bsp"
    assert "switched from bsp" in (parts / "report.txt").read_text()
    for shard in rep["_gba"]:  # the shards' buffers started at the checkpoint's next global step
        assert shard["global_step"] == STEPS and shard["contributions"] == WORKERS * (STEPS - EVERY)
        assert shard["dropped"] == 0 and shard["staleness_max"] == 0
    assert _meta(parts, STEPS - 1)["consistency"]["mode"] == "gba"
    _assert_same_model(parts, whole_bsp, 1e-5)


def test_gba_checkpoint_resumed_as_bsp_trains_the_bsp_model(tmp_path, data_dir, whole_bsp, half_gba):
    """(b) GBA iota = 0 to step 9 with a checkpoint, resumed there as BSP to step 19."""
    parts = tmp_path / "gba-then-bsp"
    shutil.copytree(half_gba, parts)
    rep = _train(data_dir, parts, "bsp", STEPS, resume=True)
    assert rep["steps"] == STEPS - EVERY and rep["consistency"]["switched_from"] == "gba"
    assert _meta(parts, STEPS - 1)["consistency"]["mode"] == "bsp"
    _assert_same_model(parts, whole_bsp, 1e-5)


def test_gba_job_with_checkpoints_resumes_exactly(tmp_path, data_dir, whole_bsp, half_gba):
    """(c) A GBA job checkpointing every 10 steps (a barrier mid-job) equals BSP; resumed
    under GBA from its step-9 checkpoint it ends with the uninterrupted GBA model."""
    whole = tmp_path / "whole-gba"
    rep = _train(data_dir, whole, "gba", STEPS)
    assert rep["steps"] == STEPS and [s["global_step"] for s in rep["_gba"]] == [STEPS]
    assert _meta(whole, EVERY - 1)["dispatcher"]["next_step"] == EVERY  # the mid-job barrier's checkpoint
    _assert_same_model(whole, whole_bsp, 1e-5)
    parts = tmp_path / "gba-then-gba"
    shutil.copytree(half_gba, parts)
    rep = _train(data_dir, parts, "gba", STEPS, resume=True)
    assert rep["steps"] == STEPS - EVERY and rep["consistency"]["switched_from"] is None
    _assert_same_model(parts, whole, 1e-6)


def test_resume_refuses_a_hyper_parameter_change_but_not_a_mode_change(tmp_path, data_dir, half_gba):
    parts = tmp_path / "changed"
    shutil.copytree(half_gba, parts)
    with pytest.raises(ConfigError, match="hyper-parameters changed") as err:  # before anything starts
        _train(data_dir, parts, "bsp", STEPS, resume=True, lr=0.1, batch_size=4)
    assert "--lr 0.01 -> 0.1" in str(err.value) and "--batch-size 8 -> 4" in str(err.value)
    assert "only --consistency" in str(err.value)
    ckpt = checkpoints.latest(parts / "checkpoints")
    assert checkpoints.check_resume_config(ckpt, _cfg(data_dir, parts, "gba", STEPS, gba_threshold=2)) is None
    assert checkpoints.check_resume_config(ckpt, _cfg(data_dir, parts, "bsp", STEPS)) == "gba"
    assert checkpoints.check_resume_config(ckpt, _cfg(data_dir, parts, "bounded", STEPS, staleness=1)) == "gba"


# ------------------------------------------------------------- in-process pieces
def test_a_buffer_started_at_a_checkpoint_step_gates_and_logs_from_there():
    """NOTE [gba checkpoints]: a resumed shard's buffer starts at the checkpoint's next step."""
    from herald.errors import ProtocolError
    from herald.ps.gba import Contribution, GradientBuffer

    applied = []
    buf = GradientBuffer(2, 0, lambda t, k, g: applied.append((buf.global_step - 1, k.tolist())), start_step=10)
    assert buf.ready(10) and not buf.ready(11)
    dense = np.ones(3, np.float32)
    for slot in range(2):
        assert (
            buf.add(Contribution(10, slot, slot, [(0, np.array([7], np.uint64), np.ones((1, 2), np.float32))], dense))[
                "staleness"
            ]
            == 0
        )
    assert buf.global_step == 11 and applied == [(10, [7])]
    grads, kept = buf.dense_since(10)
    assert kept.tolist() == [2] and grads.tolist() == [[2.0, 2.0, 2.0]]
    with pytest.raises(ProtocolError, match="already received"):  # tokens before the start count as done
        buf.add(Contribution(9, 0, 0, [], None))
    with pytest.raises(ProtocolError, match="started at 10"):
        buf.check_settings(2, 0, 0)
    with pytest.raises(ProtocolError, match="start step"):
        GradientBuffer(2, 0, lambda *a: None, start_step=-1)


def test_gba_dense_resumes_from_a_checkpoint_folder(tmp_path):
    """GbaDense.load: BSP's dense.pt format, and the next global step from meta.json."""
    from herald.errors import DataError
    from herald.worker.consistency_gba import GbaDense

    torch.manual_seed(0)
    saved = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(saved.parameters(), lr=0.1)
    saved(torch.ones(2, 3)).sum().backward()
    opt.step()
    torch.save({"model": saved.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "dense.pt")
    model = torch.nn.Linear(3, 1)
    dense = GbaDense(model, torch.optim.Adam(model.parameters(), lr=0.1))
    with pytest.raises(DataError, match="unreadable"):
        dense.load(tmp_path, torch.device("cpu"))  # no meta.json
    (tmp_path / "meta.json").write_text(json.dumps({"step": 9, "dispatcher": {"next_step": 10}}))
    dense.load(tmp_path, torch.device("cpu"))
    assert dense.next_step == dense.start_step == 10
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    assert dense.optimizer.state_dict()["state"][0]["step"] == 1
