"""One dispatcher per training group: groups that read their own data and never wait for each other.

NOTE [independent groups]
~~~~~~~~~~~~~~~~~~~~~~~~~
HT §3, §3.1 gets its speed-up from groups that each read
their own data and train at their own pace; only their dense replicas are averaged, in the
background. ``herald train --groups G --consistency hybrid`` does this:

1. **One dispatcher per group.** G dispatchers run in the launcher's process (one thread
   each, :func:`run_group_attempt`); dispatcher ``g`` serves group ``g``'s k = W / G ranks
   as ranks 0..k-1 of its own sub-job (``JobSpec.group_index`` g: the worker's
   torch.distributed rank is ``g * k + r``, :func:`herald.worker.groups.world_position`),
   with its own scheduler, credit window and ``--dispatcher-rank`` g (the top 8 bits of
   its sample ids, Persia §4.1). The ranks of all groups still form one torch.distributed
   world: the group all-reduce and the leaders' EASGD group of NOTE [training groups].
2. **Their own share of the data.** One producer reads global batches of k x batch size
   samples (:class:`SharedBatches`); whichever dispatcher asks first takes the next one,
   so the groups' samples are disjoint and together are the samples G = 1 trains (``--steps
   S`` is S rounds: G x S group batches, S x W x batch size samples, as G = 1). A group
   slowed by a straggler takes fewer batches; the others go on: nobody waits for it. The
   low 56 bits of a sample id are its position in the producer's stream
   (:meth:`GroupBatches.sample_ids`), so ``--log-sample-ids`` shows who trained what.
3. **Shared PS shards.** Hybrid workers never push to the PS; each dispatcher pushes its
   group's summed gradients with ``contributors`` 1 and rank 0. Under NOTE [ps
   aggregation] such a push is applied at once and leaves no (key, step) state behind, so
   two groups pushing the same key for the same step number do not collide (both are
   applied). The exact modes (bsp, bounded, gba) aggregate per (key, step) across the
   ranks of one job and keep the single dispatcher with ``--groups`` (lockstep groups).
4. **The end.** Groups stop when the producer runs dry (or at a signal); a leader whose
   group finished keeps taking part in EASGD rounds until every leader finished (the
   drain of NOTE [training groups]), so no collective is left waiting.

Not supported here (refused with the fix named): checkpoints and ``--resume`` (each
dispatcher would need its own position in the shared stream), Kafka sources.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from herald.dispatch.dispatcher import Dispatcher, StepRecord
from herald.dispatch.microbatch import make_sample_ids
from herald.errors import ConfigError, HeraldError
from herald.job import report as report_mod
from herald.job import report_comm
from herald.job.data import JobData
from herald.job.report import final_loss
from herald.job.runner import (JobInterrupted, LocalProcesses, StopOnSignals, dispatcher_config, finish_job,
                               prepare_run)
from herald.loader.batch import SampleBatch
from herald.spec.flags import flag_errors
from herald.spec.job import JobSpec
from herald.spec.modes import consistency_mode


def independent_groups(cfg: Any) -> bool:
    """Whether ``cfg`` runs one dispatcher per group (NOTE [independent groups]): ``--groups`` > 1
    under a mode whose entry in :data:`herald.spec.modes.MODES` says so (hybrid).

    Raises:
        ConfigError: such a job with checkpoints, ``--resume`` or a Kafka source.
    """
    if getattr(cfg, "groups", 1) <= 1 or not consistency_mode(cfg.consistency).independent_groups:   # hybrid
        return False
    for on, flag in ((cfg.checkpoint_every, "--checkpoint-every"), (cfg.resume, "--resume"),
                     (cfg.is_stream, "a kafka:// source")):
        if on:
            raise ConfigError(f"--groups {cfg.groups} --consistency {cfg.consistency} (one dispatcher per group) "
                              f"does not support {flag} yet: drop it, or use --groups 1")
    return True


class SharedBatches:
    """Global batches handed to whichever group asks first (thread-safe; NOTE [independent groups] 2)."""

    def __init__(self, batches: Iterable[SampleBatch]):
        self._it, self._lock, self._next, self._done = iter(batches), threading.Lock(), 0, False

    def take(self) -> tuple[int, SampleBatch] | None:
        """``(index in the stream, batch)``, or None once the stream ended."""
        with self._lock:
            if self._done:
                return None
            batch = next(self._it, None)
            if batch is None:
                self._done = True
                return None
            index, self._next = self._next, self._next + 1
            return index, batch

    def stop(self) -> None:
        """Hand out nothing more (thread-safe)."""
        with self._lock:
            self._done = True


class GroupBatches:
    """Group ``group``'s view of a :class:`SharedBatches` for its dispatcher: an iterator of
    batches of ``batch_rows`` samples; ``taken``: their indices in the shared stream."""

    def __init__(self, shared: SharedBatches, group: int, batch_rows: int):
        self._shared, self.group, self.batch_rows = shared, group, batch_rows
        self.taken: list[int] = []

    def __iter__(self) -> GroupBatches:
        return self

    def __next__(self) -> SampleBatch:
        got = self._shared.take()
        if got is None:
            raise StopIteration
        self.taken.append(got[0])
        return got[1]

    def sample_ids(self, local_index: int) -> np.ndarray:
        """uint64 [batch_rows]: ``group << 56 | position in the shared stream`` of this
        dispatcher's batch ``local_index`` (the dispatcher's own count)."""
        return make_sample_ids(self.group, self.taken[local_index] * self.batch_rows, self.batch_rows)


def group_config(cfg: Any) -> Any:
    """The sub-job one group's dispatcher runs: k = W / G workers, G x ``steps`` batches of
    the shared stream (so the groups together train ``steps`` rounds' samples), no straggler
    flag (the worker applies it by its global rank) and one group."""
    return dataclasses.replace(cfg, workers=cfg.workers // cfg.groups, groups=1, slow_worker=None,
                               steps=None if cfg.steps is None else cfg.steps * cfg.groups)


def stream_summary(records: list[list[StepRecord]], views: list[GroupBatches], wall_s: float) -> dict[str, Any]:
    """The ``group_streams`` report block: per group steps, samples, samples/s over its own
    steady span, ``final_loss`` (mean of its last 10 acks: the job's own mixes the groups'
    tails, mostly the slowest group's), shared-stream batches taken (first and last); the
    job's totals."""
    per = []
    for g, (recs, view) in enumerate(zip(records, views)):
        span = recs[-1].acked_at - recs[0].acked_at if len(recs) > 1 else 0.0
        per.append({"group": g, "steps": len(recs), "samples": len(recs) * view.batch_rows,
                    "samples_per_second": (len(recs) - 1) * view.batch_rows / span if span > 0 else float("nan"),
                    "final_loss": final_loss(recs),
                    "batches_taken": len(view.taken),
                    "first_batch": view.taken[0] if view.taken else None,
                    "last_batch": view.taken[-1] if view.taken else None})
    return {"groups": per, "samples": sum(p["samples"] for p in per), "wall_seconds": wall_s}


def merge_records(records: list[list[StepRecord]]) -> list[StepRecord]:
    """Every group's step records in the order their last ack arrived."""
    return sorted((r for recs in records for r in recs), key=lambda r: r.acked_at)


class _AllDispatchers:
    """``stop()`` of every group's dispatcher and of the shared stream (for a signal handler)."""

    def __init__(self, disps: list[Dispatcher], shared: SharedBatches):
        self.disps, self.shared = disps, shared

    def stop(self) -> None:
        self.shared.stop()
        for d in self.disps:
            d.stop()


def _serve_all(disps: list[Dispatcher], stop_all: _AllDispatchers) -> list[list[StepRecord]]:
    """Run every dispatcher's :meth:`Dispatcher.serve` on a thread of its own; the first
    error stops the others (each serve is bounded by its peer timeout) and is raised."""
    results: list[Any] = [None] * len(disps)

    def serve(g: int) -> None:
        try:
            results[g] = disps[g].serve()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the launcher's thread below
            results[g] = exc
            stop_all.stop()

    threads = [threading.Thread(target=serve, args=(g,), name=f"herald-dispatcher-group-{g}", daemon=True)
               for g in range(len(disps))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return results


def run_group_attempt(cfg: Any, *, progress: bool, on_finish, failovers: list[dict[str, Any]]) -> dict[str, Any]:
    """``herald train`` with one dispatcher per group (NOTE [independent groups]); the same
    processes (:class:`herald.job.runner.LocalProcesses`), report and errors as
    :func:`herald.job.launcher.run_train` otherwise.

    Raises:
        ConfigError: bad settings; HeraldError: a child process failed (named);
        JobInterrupted: stopped by SIGINT / SIGTERM.
    """
    run_dir = prepare_run(cfg)
    sub = group_config(cfg)
    k, G = sub.workers, cfg.groups
    data = JobData(sub)
    with flag_errors():
        new_scheduler = data.scheduler_factory(sub)
    shared = SharedBatches(data.batches)
    views = [GroupBatches(shared, g, sub.global_batch) for g in range(G)]
    id_log = open(run_dir / "trained_sample_ids.u64", "ab") if cfg.log_sample_ids else None
    records: list[list[StepRecord]] = [[] for _ in range(G)]
    t_start = time.perf_counter()
    with LocalProcesses(cfg, data) as local:
        job = JobSpec.build(cfg, data, list(local.shards.addresses)).replace(dist_init=local.dist_init)
        bar = report_mod.Progress(sub, enabled=progress, total_steps=data.total_steps(sub),
                                  skipped=lambda: data.batches.skipped)
        bar_lock = threading.Lock()

        def on_step(rec: StepRecord) -> None:
            with bar_lock:
                bar.update(rec)

        interrupted = None
        try:
            with contextlib.ExitStack() as stack:
                disps = []
                for g in range(G):
                    disp_cfg = dispatcher_config(cfg, num_workers=k, dispatcher_rank=g)
                    disps.append(stack.enter_context(Dispatcher(
                        disp_cfg, views[g], new_scheduler, job.replace(group_index=g), on_step=on_step,
                        liveness=local.liveness, sample_id_log=id_log)))
                stop_all = _AllDispatchers(disps, shared)
                stopper = stack.enter_context(StopOnSignals(stop_all, data))
                for rank in range(cfg.workers):
                    g, r = divmod(rank, k)
                    local.start_worker(rank, disps[g].address, r, k, job)
                records = _serve_all(disps, stop_all)
                if stopper.signum is not None:
                    interrupted = {"signal": signal.Signals(stopper.signum).name,
                                   "at_step": sum(len(r) for r in records), "checkpoint": None}
                capacity_rows = disps[0].scheduler.capacity_rows
                dispatcher_s: dict[str, float] = {}
                for d in disps:
                    for name, ms in d.timer.take().items():
                        dispatcher_s[name] = dispatcher_s.get(name, 0.0) + ms / 1e3
            local.children.wait(timeout_s=60, context=" after the end of training")
        except HeraldError as exc:
            local.fail(exc)
        except BaseException:
            local.children.stop()
            raise
        finally:
            bar.close()
            if id_log is not None:
                id_log.close()
        train_s = time.perf_counter() - t_start
        ps_stats, metrics, skipped = finish_job(data, job, local.ps, local.shards.addresses, run_dir, on_finish)
    merged = merge_records(records)
    rep = report_mod.build(cfg, merged, train_s, metrics, batches_info=data.batches.info,
                           split_info=data.split_info, capacity_rows=capacity_rows, dispatcher_s=dispatcher_s,
                           ps_stats=ps_stats, skipped=skipped, interrupted=interrupted,
                           scheduler=data.scheduler_stats())
    report_comm.fix_group_samples(rep, merged, sub.global_batch, train_s)
    rep["group_streams"] = stream_summary(records, views, train_s)
    rep["replicated_tables"], rep["replica_rows_per_worker"], rep["failovers"] = [], 0, failovers
    rep["consistency"]["switched_from"] = None   # no --resume here
    # the job's steps in ack order (each group numbers its own from 0) for the plots
    report_mod.write(rep, [dataclasses.replace(r, step=i) for i, r in enumerate(merged)], run_dir)
    if interrupted is not None:
        raise JobInterrupted(interrupted, rep, run_dir)
    return rep
