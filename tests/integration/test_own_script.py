"""``herald train --script FILE [-- ARGS]``: the user's own training script as every worker
(NOTE [own script] in herald/worker/script.py): examples/train_own_model.py trains and
reports, a script that raises ends the job naming its rank, the script and the traceback,
``ScheduledLoader.connect()`` reads the job from the environment, and a missing script is
refused before anything starts."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from herald.contracts.train import TrainConfig
from herald.errors import ConfigError, HeraldError, UsageError
from herald.job.cli import check_job_inputs
from herald.job.launcher import run_train
from herald.worker.script import job_environment

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_own_model.py"
SOURCE = "synthetic://criteo?rows=4000&seed=0"


def _herald(*args: str, cwd: pathlib.Path, timeout: float = 280) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "herald", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.integration
def test_the_example_trains_two_workers_and_writes_the_report(tmp_path):
    run_dir, saved = tmp_path / "run", tmp_path / "fm.pt"
    done = _herald(
        "train", "--source", SOURCE, "--workers", "2", "--batch-size", "32", "--steps", "4",
        "--run-dir", str(run_dir), "--quiet", "--script", str(EXAMPLE), "--", "--hidden", "8", "--save", str(saved),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 4
    for rank in (0, 1):  # the script's own output is in its worker's log
        assert f"rank {rank}: trained 4 steps" in (run_dir / f"worker-{rank}.log").read_text()
    import torch

    state = torch.load(saved, weights_only=True)
    assert state["head.weight"].shape == (1, 8)  # --hidden 8 reached the script (after --)


@pytest.mark.integration
def test_the_sequence_example_trains_a_shared_table_and_a_history(tmp_path, data_dir):
    """examples/train_sequence_model.py with examples/movielens_tables.toml: a model of the
    user's own reading a sequence feature that shares the movie table with the rated item."""
    run_dir = tmp_path / "run"
    done = _herald(
        "train", "--source", str(data_dir / "movielens" / "ml-latest-small" / "ratings.csv"),
        "--source-option", "side_features=true", "--tables", str(REPO / "examples" / "movielens_tables.toml"),
        "--workers", "2", "--batch-size", "64", "--steps", "12", "--run-dir", str(run_dir), "--quiet",
        "--script", str(REPO / "examples" / "train_sequence_model.py"),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 12
    emb = report["embeddings"]
    assert [(t["name"], t["dim"]) for t in emb["tables"]] == [("user", 16), ("movies", 16), ("genres", 8)]
    history = next(f for f in emb["features"] if f["name"] == "history")
    assert (history["table"], history["pooling"], history["max_length"]) == ("movies", "none", 20)
    assert emb["sequence_truncated"] > 0  # the source keeps 50 rated movies, the feature the last 20
    assert "sequence of 20" in (run_dir / "report.txt").read_text()
    for rank in (0, 1):
        assert f"rank {rank}: trained 12 steps" in (run_dir / f"worker-{rank}.log").read_text()


RAISING = """
import os, sys
import helper  # the script's folder is first on sys.path
assert os.getcwd() not in sys.path and "" not in sys.path, sys.path  # never the current folder
assert sys.argv[1:] == ["--fail-at", "2"], sys.argv
assert os.environ["LOCAL_WORLD_SIZE"] == "2" and os.environ["WORLD_SIZE"] == "2"
assert os.environ["RANK"] == os.environ["LOCAL_RANK"]
import torch, torch.nn.functional as F
from herald.worker.api import ScheduledLoader

loader = ScheduledLoader.connect()  # no arguments: the environment herald train gives
model = torch.nn.Linear(loader.job.dense_dim + len(loader.job.tables) * loader.dim, 1)
emb = loader.embedding()
loader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
for batch in loader:
    if loader.rank == 1 and batch.step == int(sys.argv[2]):
        helper.fail(batch.step)
    x = torch.cat([batch.dense, emb(batch).flatten(1)], dim=1)
    loss = F.binary_cross_entropy_with_logits(model(x).squeeze(1), batch.labels)
    loss.backward()
    loader.step(loss)
"""


def _raising_job(tmp_path, monkeypatch, **settings) -> tuple[pathlib.Path, str]:
    """Run a job whose script raises on rank 1 at step 2; ``(script, the job's error)``."""
    folder, cwd = tmp_path / "scripts", tmp_path / "cwd"
    folder.mkdir()
    cwd.mkdir()
    (folder / "helper.py").write_text("def fail(step):\n    raise ValueError(f'boom at step {step}')\n")
    script = folder / "raising.py"
    script.write_text(textwrap.dedent(RAISING))
    monkeypatch.chdir(cwd)
    cfg = TrainConfig.from_flags(
        source=SOURCE, workers=2, batch_size=32, steps=6, eval_fraction=0.0, run_dir=str(tmp_path / "run"),
        script=str(script), script_args=("--fail-at", "2"), **settings,
    )  # fmt: skip
    with pytest.raises(HeraldError) as err:
        run_train(cfg, progress=False)
    return script, str(err.value)


def _assert_names_the_script(script: pathlib.Path, text: str) -> None:
    assert text.startswith(f"worker rank 1: script {script} raised ValueError: boom at step 2"), text
    assert "helper.py" in text and "raise ValueError(f'boom at step {step}')" in text  # the traceback's end
    assert "exited with code" not in text.splitlines()[0]


@pytest.mark.integration
def test_a_script_that_raises_names_the_rank_the_script_and_the_traceback(tmp_path, monkeypatch):
    _assert_names_the_script(*_raising_job(tmp_path, monkeypatch))


@pytest.mark.slow
@pytest.mark.integration
def test_under_ray_the_script_runs_and_its_failure_is_named(ray, tmp_path, monkeypatch):
    """``--launcher ray`` (a local Ray instance): the script runs as every worker actor's
    child (steps 0 and 1 trained) and the failure is named as under the local launcher."""
    _assert_names_the_script(*_raising_job(tmp_path, monkeypatch, launcher="ray", timeout_ms=60_000))


def test_connect_reads_the_job_from_the_environment(monkeypatch):
    for name, value in {
        "HERALD_DISPATCHER": "ipc:///tmp/x.ipc", "RANK": "1", "WORLD_SIZE": "3", "HERALD_DEVICE": "cpu",
        "HERALD_CACHE_DEVICE": "torch", "HERALD_TIMEOUT_MS": "5000", "HERALD_KEYS": "/keys",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert job_environment(None, None, None, None, None, None, None) == (
        "ipc:///tmp/x.ipc", 1, 3, "cpu", "torch", 5000, "/keys",
    )  # fmt: skip
    given = job_environment("tcp://h:1", 0, 2, "auto", "cpu", 100, None)
    assert given == ("tcp://h:1", 0, 2, "auto", "cpu", 100, "/keys")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(UsageError, match=r"world_size=.*WORLD_SIZE='x'"):
        job_environment(None, None, None, None, None, None, None)
    monkeypatch.delenv("HERALD_DISPATCHER")
    with pytest.raises(UsageError, match=r"HERALD_DISPATCHER"):
        job_environment(None, 0, 1, None, None, None, None)


def test_a_missing_script_or_a_folder_is_refused_before_anything_starts(tmp_path):
    for path, words in ((tmp_path / "nope.py", "no such file"), (tmp_path, "give a file")):
        cfg = TrainConfig.from_flags(source=SOURCE, run_dir=str(tmp_path / "run"), script=str(path))
        with pytest.raises(ConfigError, match=f"--script {path}.*{words}"):
            check_job_inputs(cfg)
    done = _herald("train", "--source", SOURCE, "--run-dir", str(tmp_path / "run"), "--script", "nope.py", cwd=tmp_path)
    assert done.returncode == 2 and "--script nope.py: no such file" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # nothing started
    with pytest.raises(ConfigError, match=r"given for no script: pass --script FILE"):
        TrainConfig.from_flags(source=SOURCE, script_args=("--lr", "1"))
