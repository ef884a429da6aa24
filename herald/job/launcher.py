"""``herald train``: PS shards, the dispatcher and N workers as local processes.

The dispatcher runs in this process (so progress and the report come from one
place); each PS shard and each worker is a child process started with
``python -m herald serve ...``. A child that exits early is reported by name and
the whole job stops (children are terminated with a bounded wait: no orphans).
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import sys
import time
from typing import Any

from herald.errors import HeraldError
from herald.procs import Supervisor
from herald.ps import LocalShards, PSClient
from herald.ps.config import ShardLimits
from herald.dispatch.dispatcher import Dispatcher, DispatcherConfig, StepRecord
from herald.job import checkpoints
from herald.job.data import JobData
from herald.job.spec import JobSpec, TrainConfig, flag_errors

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(cfg: TrainConfig, *, progress: bool = True, on_finish=None) -> dict[str, Any]:
    """Run a whole training job; returns the report dict (also written to ``run_dir``).

    ``on_finish(ps_addresses, job)``, if given, runs after the final flush while the PS
    shards are still up (tests read the trained rows there). SIGINT / SIGTERM end the
    job cleanly at the next step (with a final checkpoint when checkpointing is on); the
    report (``interrupted``) is written and then :class:`JobInterrupted` is raised.

    Raises:
        ConfigError: bad settings; HeraldError: a child process failed (named);
        JobInterrupted: stopped by SIGINT / SIGTERM (exit status 130 / 143).
    """
    from herald.job import report as report_mod

    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = JobData(cfg)
    # --resume: PS rows, dense state and the dispatcher's state (next step, next batch,
    # producer position) of the latest checkpoint (herald/job/checkpoints.py)
    resume = checkpoints.latest(run_dir / "checkpoints") if cfg.resume else None
    resume_state = resume.dispatcher_state if resume is not None else None
    if cfg.resume and resume is None:
        print(f"herald train --resume: no checkpoint in {run_dir / 'checkpoints'}; starting at step 0",
              file=sys.stderr)
    with flag_errors():
        new_scheduler = data.scheduler_factory(cfg)

    children = Supervisor(run_dir, new_session=True, env={
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    records: list[StepRecord] = []
    id_log = open(run_dir / "trained_sample_ids.u64", "ab") if cfg.log_sample_ids else None
    t_start = time.perf_counter()
    # ipc: every process is local, and ZeroMQ over Unix sockets moves ~2x the bytes of
    # TCP loopback here (docs/ps.md, benchmark)
    # NOTE [ps liveness] (herald/ps/watch.py): shard logs in the run folder (ps-shard-I.log),
    # an aggregation a dead worker leaves open is aborted within the job's timeout
    with LocalShards(num_shards=cfg.num_ps_shards, tables=cfg.tables(data.schema), seed=cfg.seed,
                     transport="ipc", log_dir=run_dir,
                     limits=ShardLimits(aggregation_timeout_ms=cfg.timeout_ms)) as shards, \
            PSClient(list(shards.addresses), tables=cfg.tables(data.schema), timeout_ms=cfg.timeout_ms,
                     num_workers=cfg.workers) as ps:
        # a dead shard is named at the next check, a silent one after half the job's timeout
        ps_alive = shards.watch(silent_ms=max(1, cfg.timeout_ms // 2))
        if resume is not None:
            ps.restore(str(resume.path / "ps"))
        job = JobSpec.build(cfg, data, list(shards.addresses)).replace(
            dist_init=f"tcp://127.0.0.1:{_free_port()}", resume_dense=str(resume.path) if resume else None)
        ckpt = checkpoints.Checkpointer(run_dir / "checkpoints", lambda path: ps.checkpoint(path),
                                        position=data.position, commit=data.commit)
        use_ckpt = bool(cfg.checkpoint_every or cfg.is_stream)
        bar = report_mod.Progress(cfg, enabled=progress, total_steps=data.total_steps(cfg),
                                  skipped=lambda: data.batches.skipped)
        with flag_errors():
            disp_cfg = DispatcherConfig(num_workers=cfg.workers, max_inflight_steps=cfg.max_inflight_steps,
                                        peer_timeout_ms=cfg.timeout_ms, checkpoint_every_steps=cfg.checkpoint_every)
        interrupted = None
        try:
            with Dispatcher(disp_cfg, data.batches, new_scheduler, job, on_step=bar.update,
                            on_checkpoint=ckpt.save if use_ckpt else None,
                            checkpoint_path=ckpt.staging_path if use_ckpt else None,
                            liveness=lambda: (ps_alive(), children.check()), sample_id_log=id_log) as disp, \
                    _stop_on_signals(disp, data) as stopper:
                if resume_state is not None:
                    disp.load_state_dict(resume_state)
                for rank in range(cfg.workers):
                    children.start(f"worker-{rank}", [sys.executable, "-m", "herald", "serve", "worker",
                                                      "--dispatcher", disp.address, "--rank", str(rank),
                                                      "--world-size", str(cfg.workers),
                                                      "--timeout-ms", str(cfg.timeout_ms)])
                records = disp.serve()
                if stopper.signum is not None:
                    # at_step: steps trained = where --resume continues; checkpoint: its folder
                    interrupted = {"signal": signal.Signals(stopper.signum).name, "at_step": disp.next_step,
                                   "checkpoint": f"step-{disp.checkpoints[-1]:08d}"
                                   if use_ckpt and disp.checkpoints else None}
                capacity_rows = disp.scheduler.capacity_rows
                dispatcher_s = {k: v / 1e3 for k, v in disp.timer.take().items()}
            children.wait(timeout_s=60, context=" after the end of training")
        except HeraldError as exc:
            # a dead or silent PS shard is the cause of whatever the workers report next
            cause = ps_alive.failure() or children.failure(grace_s=2.0)
            children.stop()
            if "TrainingDiverged: " in str(exc):   # the worker's own diagnosis (step, rank, cause) says it all
                raise HeraldError(str(exc).split("TrainingDiverged: ", 1)[1]) from None
            if cause and cause not in str(exc):
                raise HeraldError(f"{cause}\n(then: {exc})") from exc
            raise
        except BaseException:
            children.stop()
            raise
        finally:
            bar.close()
            if id_log is not None:
                id_log.close()
        train_s = time.perf_counter() - t_start
        ps_stats = ps.stats()
        if on_finish is not None:
            on_finish(list(shards.addresses), job)
        metrics = (report_mod.evaluate(job, data.eval_source, run_dir, shards.addresses)
                   if data.eval_source is not None else {})
        data.close()
    skipped = {"train": dict(data.batches.skipped),
               "eval": dict(data.eval_source.stats["skipped"]) if data.eval_source is not None else {}}
    rep = report_mod.build(cfg, records, train_s, metrics, batches_info=data.batches.info, split_info=data.split_info,
                           capacity_rows=capacity_rows, dispatcher_s=dispatcher_s, ps_stats=ps_stats,
                           skipped=skipped, interrupted=interrupted)
    rep["replicated_tables"] = [data.schema.table_names[t] for t in data.replicated]
    rep["replica_rows_per_worker"] = data.replica_rows
    report_mod.write(rep, records, run_dir)
    if interrupted is not None:
        raise JobInterrupted(interrupted, rep, run_dir)
    return rep


class JobInterrupted(HeraldError):
    """``herald train`` stopped cleanly on SIGINT or SIGTERM (report and final checkpoint
    written). ``exit_code`` is 128 + the signal number (130 SIGINT, 143 SIGTERM), what a
    shell reports for a process the signal ended; ``report`` is the job's report dict."""

    def __init__(self, interrupted: dict[str, Any], report: dict[str, Any], run_dir: pathlib.Path):
        self.report, self.signal_name, self.at_step = report, interrupted["signal"], interrupted["at_step"]
        self.exit_code = 128 + int(signal.Signals[self.signal_name])
        folder = interrupted.get("checkpoint")
        resume = (f"checkpoint {run_dir / 'checkpoints' / folder} written: continue with the same options and "
                  "--resume" if folder is not None else
                  "no checkpoint (run with --checkpoint-every STEPS to be able to --resume)")
        super().__init__(f"interrupted by {self.signal_name} at step {self.at_step}; report in "
                         f"{run_dir / 'report.txt'}; {resume}")


class _stop_on_signals:
    """While active, SIGINT and SIGTERM stop the dispatcher at the next step boundary;
    ``signum`` is the first signal received (None: none)."""

    def __init__(self, disp: Dispatcher, data: JobData):
        self.disp, self.data, self.saved = disp, data, {}
        self.signum: int | None = None

    def _handler(self, signum, frame) -> None:
        print(f"herald train: {signal.Signals(signum).name}: stopping after the current step", file=sys.stderr)
        if self.signum is None:
            self.signum = signum
        self.disp.stop()
        self.data.interrupt()

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.saved[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self.saved.items():
            signal.signal(sig, old)

