"""One dispatcher per training group: groups that read their own data and never wait for each other.

NOTE [independent groups]
~~~~~~~~~~~~~~~~~~~~~~~~~
HT §3, §3.1 gets its speed-up from groups that each read
their own data and train at their own pace; only their dense replicas are averaged, in the
background. ``herald train --groups G --consistency hybrid`` does this:

1. **One dispatcher per group.** G dispatchers run in the launcher's process (one thread
   each, :func:`serve_all`; the job runner takes this layout when it starts the workers
   itself: NOTE [job runner] in herald/job/runner.py); dispatcher ``g`` serves group
   ``g``'s k = W / G ranks as ranks 0..k-1 of its own sub-job (``JobSpec.group_index`` g:
   the worker's torch.distributed rank is ``g * k + r``,
   :func:`herald.worker.groups.world_position`), with its own scheduler, credit window
   and ``--dispatcher-rank`` g (the top 8 bits of its sample ids, Persia §4.1). The ranks
   of all groups still form one torch.distributed world: the group all-reduce and the
   leaders' EASGD group of NOTE [training groups].
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
dispatcher would need its own position in the shared stream), Kafka sources. Workers
started elsewhere (``herald serve dispatcher``, the test bed) get the single dispatcher
(lockstep groups): only the runner's own workers can be sent to their group's dispatcher.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from herald.contracts.microbatch import make_sample_ids
from herald.contracts.modes import consistency_mode
from herald.dispatch.dispatcher import Dispatcher
from herald.dispatch.records import StepRecord
from herald.errors import ConfigError
from herald.job.report import final_loss
from herald.loader.batch import SampleBatch


def independent_groups(cfg: Any) -> bool:
    """Whether ``cfg`` runs one dispatcher per group (NOTE [independent groups]): ``--groups`` > 1
    under a mode whose entry in :data:`herald.contracts.modes.MODES` says so (hybrid).

    Raises:
        ConfigError: such a job with checkpoints, ``--resume`` or a Kafka source.
    """
    if cfg.groups.count <= 1 or not consistency_mode(cfg.consistency).independent_groups:  # hybrid
        return False
    for on, flag in (
        (cfg.checkpoint_every, "--checkpoint-every"),
        (cfg.resume, "--resume"),
        (cfg.is_stream, "a kafka:// source"),
    ):
        if on:
            raise ConfigError(
                f"--groups {cfg.groups.count} --consistency {cfg.consistency} (one dispatcher per group) "
                f"does not support {flag} yet: drop it, or use --groups 1"
            )
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
    return cfg.with_flags(
        workers=cfg.workers // cfg.groups.count,
        groups=1,
        slow_worker=None,
        steps=None if cfg.steps is None else cfg.steps * cfg.groups.count,
    )


def stream_summary(records: list[list[StepRecord]], views: list[GroupBatches], wall_s: float) -> dict[str, Any]:
    """The ``group_streams`` report block: per group steps, samples, samples/s over its own
    steady span, ``final_loss`` (mean of its last 10 acks: the job's own mixes the groups'
    tails, mostly the slowest group's), shared-stream batches taken (first and last); the
    job's totals."""
    per = []
    for g, (recs, view) in enumerate(zip(records, views)):
        span = recs[-1].acked_at - recs[0].acked_at if len(recs) > 1 else 0.0
        per.append(
            {
                "group": g,
                "steps": len(recs),
                "samples": len(recs) * view.batch_rows,
                "samples_per_second": (len(recs) - 1) * view.batch_rows / span if span > 0 else float("nan"),
                "final_loss": final_loss(recs),
                "batches_taken": len(view.taken),
                "first_batch": view.taken[0] if view.taken else None,
                "last_batch": view.taken[-1] if view.taken else None,
            }
        )
    return {"groups": per, "samples": sum(p["samples"] for p in per), "wall_seconds": wall_s}


def merge_records(records: list[list[StepRecord]]) -> list[StepRecord]:
    """Every group's step records in the order their last ack arrived."""
    return sorted((r for recs in records for r in recs), key=lambda r: r.acked_at)


class AllDispatchers:
    """``stop()`` of every group's dispatcher and of the shared stream (for a signal handler)."""

    def __init__(self, disps: list[Dispatcher], shared: SharedBatches):
        self.disps, self.shared = disps, shared

    def stop(self) -> None:
        self.shared.stop()
        for d in self.disps:
            d.stop()


def serve_all(disps: list[Dispatcher], stop_all: AllDispatchers) -> list[list[StepRecord]]:
    """Run every dispatcher's :meth:`Dispatcher.serve` on a thread of its own; the first
    error stops the others (each serve is bounded by its peer timeout) and is raised."""
    results: list[Any] = [None] * len(disps)

    def serve(g: int) -> None:
        try:
            results[g] = disps[g].serve()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the runner's thread below
            results[g] = exc
            stop_all.stop()

    threads = [
        threading.Thread(target=serve, args=(g,), name=f"herald-dispatcher-group-{g}", daemon=True)
        for g in range(len(disps))
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return results
