"""The dispatcher host's program on the test bed: ``herald serve dispatcher`` plus the
job's report, the workers' dense replicas and (optionally) a final PS checkpoint.

    python -m herald.testbed.dispatcher --config job.json --bind tcp://10.200.7.2:5555 \
        --ps tcp://10.200.7.1:6000 [--save-ps RUN_DIR/ps-final]

Why not ``herald serve dispatcher`` itself: it sends the workers no run folder (they
keep their dense replicas to themselves) and writes no report, so a multi-host job
has no samples/s, bytes per cause or AUC to show, and no model to compare with the
single-process reference. On the test bed every host sees the same file system, so
this program gives the job ``cfg.run_dir``: the workers write ``dense-rank<r>.pt``
there, and this program writes ``report.json`` / ``report.txt`` there as ``herald
train`` does (the same job runner and report: NOTE [job runner] in
herald/job/runner.py), evaluating the held-out split once every rank's replica is
written. The settings are a :class:`~herald.contracts.train.TrainConfig`
as JSON (unknown keys raise). The PS admin token (NOTE [ps admin ops]) comes from
``HERALD_PS_TOKEN`` in the environment, never from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any

from herald.contracts.train import TrainConfig
from herald.errors import ConfigError, HeraldError, PeerTimeout
from herald.job.interfaces import JobHooks, RunOptions
from herald.job.parts import Checkpointing, ExternalWorkers, RemotePS
from herald.job.runner import JobReport, JobRunner


def load_config(path: str | os.PathLike):
    """The :class:`~herald.contracts.train.TrainConfig` stored as JSON at ``path`` (by :func:`save_config`).

    Raises:
        ConfigError: unreadable file, not a JSON object, an unknown key or a bad value.
    """
    try:
        values = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the job settings {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a JSON object of TrainConfig settings")
    values["source_options"] = tuple(tuple(kv) for kv in values.get("source_options", ()))
    return TrainConfig.from_flags(values, where=f"job settings {path}")


def save_config(cfg, path: str | os.PathLike) -> pathlib.Path:
    """Write ``cfg`` (a :class:`~herald.contracts.train.TrainConfig`) as JSON to ``path``: its settings by flag."""
    path = pathlib.Path(path)
    path.write_text(json.dumps(cfg.flags(), indent=1))
    return path


def wait_for_dense(run_dir: pathlib.Path, workers: int, timeout_s: float) -> None:
    """Wait until every rank's ``dense-rank<r>.pt`` is in ``run_dir`` (the workers write
    them after the dispatcher's ``end``).

    Raises:
        PeerTimeout: a rank's file is still missing after ``timeout_s`` (ranks named).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(workers) if not (run_dir / f"dense-rank{r}.pt").exists()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise PeerTimeout(
                f"worker rank(s) {missing} wrote no dense-rank<r>.pt into {run_dir} within "
                f"{timeout_s:.0f} s of the end of training: read their logs",
                peer=f"ranks {missing}",
            )
        time.sleep(0.1)


class TestBedWorkers(ExternalWorkers):
    """The test bed's workers: torchruns on the worker hosts (started by
    :func:`herald.testbed.job.run_job`), which write their dense replicas into the shared
    run folder: stale ones are removed before the job, and the evaluation waits up to
    ``dense_timeout_s`` for this job's (:func:`wait_for_dense`)."""

    def __init__(self, dense_timeout_s: float = 120.0):
        super().__init__()
        self.dense_timeout_s = dense_timeout_s

    def prepare(self, cfg) -> None:
        run_dir = pathlib.Path(cfg.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob("dense-rank*.pt"):
            stale.unlink()

    def replicas_written(self, cfg) -> None:
        wait_for_dense(pathlib.Path(cfg.run_dir).resolve(), cfg.workers, self.dense_timeout_s)


def serve(
    cfg, bind: str, ps: list[str], *, save_ps: str | None = None, dense_timeout_s: float = 120.0
) -> dict[str, Any]:
    """Serve the job ``cfg`` to its workers from ``bind``, PS shards at ``ps``; write and
    return the report (``cfg.run_dir/report.json``): the job runner (NOTE [job runner] in
    herald/job/runner.py) with remote PS shards, the torchruns' workers
    (:class:`TestBedWorkers`) and the report. ``cfg.checkpoint_every`` / ``cfg.resume``
    checkpoint and resume as ``herald train`` does; the step last acked by every worker is
    kept in ``cfg.run_dir/.dispatcher-step`` (the supervisor's evidence of a failover: NOTE
    [test bed failover] in herald/testbed/job.py); ``save_ps``: after training, checkpoint
    the PS into this folder.

    Raises:
        ConfigError: bad settings or keys; ShardLost: a PS shard was lost (exit status 75,
        NOTE [ps failover across hosts]); HeraldError / PeerTimeout: a worker failed.
    """
    run_dir = pathlib.Path(cfg.run_dir).resolve()
    remote = RemotePS(ps, run_dir=str(run_dir))

    def checkpoint_ps(addresses, job) -> None:
        remote.client.checkpoint(str(pathlib.Path(save_ps).resolve()))

    # the job's run_dir: the shared folder; its dist_init None: env:// under torchrun
    return (
        JobRunner(
            ps=remote,
            workers=TestBedWorkers(dense_timeout_s),
            checkpoints=Checkpointing("herald test bed dispatcher", enabled=cfg.checkpoint_every > 0),
            report=JobReport(),
            hooks=JobHooks(
                on_step=_StepFile(run_dir / ".dispatcher-step"), on_finish=checkpoint_ps if save_ps else None
            ),
            options=RunOptions(dispatcher_settings={"bind": bind}),
        )
        .run(cfg)
        .report
    )


class _StepFile:
    """``on_step``: writes the step every worker acked last into a small file (replaced
    atomically), read by the test bed's supervisor (NOTE [test bed failover])."""

    def __init__(self, path: pathlib.Path):
        self.path, self._tmp = path, path.with_name(path.name + ".tmp")

    def __call__(self, rec) -> None:
        self._tmp.write_text(str(int(rec.step)))
        os.replace(self._tmp, self.path)


def last_step(run_dir: str | os.PathLike) -> int | None:
    """The step the test bed's dispatcher saw acked last (:class:`_StepFile`), or None."""
    try:
        return int((pathlib.Path(run_dir) / ".dispatcher-step").read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m herald.testbed.dispatcher",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="TrainConfig settings as JSON (run_dir: a folder every host sees)")
    p.add_argument("--bind", required=True, help="endpoint to bind, e.g. tcp://10.200.7.2:5555")
    p.add_argument("--ps", required=True, help="comma-separated PS shard endpoints, in shard order")
    p.add_argument(
        "--save-ps",
        default=None,
        help="after training, checkpoint the PS into this folder (inside the shards' --checkpoint-root)",
    )
    p.add_argument(
        "--dense-timeout-s",
        type=float,
        default=120.0,
        help="longest wait for the workers' dense replicas after training (default: %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        rep = serve(
            load_config(args.config),
            args.bind,
            args.ps.split(","),
            save_ps=args.save_ps,
            dense_timeout_s=args.dense_timeout_s,
        )
    except HeraldError as exc:
        print(f"herald dispatcher: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", None) or 1)  # ShardLost: 75 (NOTE [ps failover across hosts])
    print(
        f"dispatcher: {rep['steps']} steps, {rep['samples_per_second']:,.0f} samples/s; report in "
        f"{pathlib.Path(rep['config']['run_dir']) / 'report.json'}",
        flush=True,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
