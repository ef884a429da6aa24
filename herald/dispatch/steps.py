"""The build stage of the dispatcher's pipeline: a scheduled step -> encoded micro-batches.

One call per step, on the build thread (NOTE [dispatch pipeline] in
:mod:`herald.dispatch.pipeline`), in step order because of NOTE [early pulls]: the
keys step t touches decide which pulls of step t + 1 may start early.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from herald import wire
from herald.contracts.microbatch import MicroBatch, make_sample_ids
from herald.contracts.plan import KeySet
from herald.dispatch.early import TouchedKeys, early_pulls, touched_keys
from herald.dispatch.microbatch import build_parts
from herald.loader.batch import SampleBatch


@dataclasses.dataclass
class ReadyStep:
    """One step built by the pipeline, ready to send.

    Attributes:
        step: the step number; batch_index: its global batch.
        micro_batches: one :class:`MicroBatch` per rank, in rank order.
        frames: per rank, the :func:`herald.wire.pack` frames of its micro-batch.
        counts: int64 [num_workers, len(CAUSES)] from the scheduler.
        schedule_ms: the scheduler's time for the submit that produced the plan.
        sample_ids: uint64 [global batch], in the global batch's order.
    """

    step: int
    batch_index: int
    micro_batches: list[MicroBatch]
    frames: list[list]
    counts: np.ndarray
    schedule_ms: float
    sample_ids: np.ndarray


def replicated_union(
    batch: SampleBatch, replicated: tuple[int, ...], feature_tables: tuple[int, ...] | None = None
) -> KeySet:
    """The keys that ``batch``'s ``replicated`` features (those reading a replicated table) use,
    sorted by (table, id), each once (docs/design.md, "Replicated tables").

    Args:
        feature_tables: the table of each feature (NOTE [tables and features] in
            herald/contracts/features.py); None: feature t reads table t.
    """
    if not replicated:
        return KeySet.empty()
    ids = [np.unique(batch.values[f]) for f in replicated]
    of = (lambda f: f) if feature_tables is None else feature_tables.__getitem__
    tables = np.concatenate([np.full(u.shape[0], of(f), np.int32) for f, u in zip(replicated, ids)])
    keys = np.concatenate(ids)
    if feature_tables is None:
        return KeySet(tables, keys)
    order = np.lexsort((keys, tables))
    tables, keys = tables[order], keys[order]
    first = np.ones(keys.shape[0], bool)
    first[1:] = (tables[1:] != tables[:-1]) | (keys[1:] != keys[:-1])
    return KeySet(tables[first], keys[first])


def build_ready_step(
    step: int,
    step_plan: Any,
    batch: SampleBatch,
    batch_index: int,
    sample_ids: np.ndarray | None,
    schedule_ms: float,
    *,
    dispatcher_rank: int,
    replicated: tuple[int, ...],
    touched_before: TouchedKeys | None,
    next_follows: bool = False,
    reads_early: bool = True,
    feature_tables: tuple[int, ...] | None = None,
) -> tuple[ReadyStep, TouchedKeys | None]:
    """Cut ``batch`` by ``step_plan.assignment``, compress every rank's micro-batch
    (one kernel pass for all ranks), mark its early pulls and encode its frames.

    Args:
        step: the step number; step_plan: the scheduler's :class:`StepPlan` for ``batch``.
        batch: the global batch; batch_index: its index.
        sample_ids: uint64 [global batch] from the producer (Kafka), or None:
            ``dispatcher_rank << 56 | batch_index * global batch + i``.
        schedule_ms: carried to the step's record.
        replicated: the features reading replicated tables (every rank gets the union of their
            keys); feature_tables: the table of each feature, None: feature t reads table t.
        touched_before: the keys the previous step touches (None: unknown, no early pulls).
        next_follows: step ``step + 1`` is sent next, within the credit window (``MicroBatch.next_follows``).
        reads_early: the job's workers read early (:attr:`herald.contracts.consistency.ModeSettings.reads_early`);
            False: no pull is marked early and no touched keys are computed.

    Returns:
        The :class:`ReadyStep` and the keys this step touches (for the next call; None
        without ``reads_early``).
    """
    gb, W = len(batch), len(step_plan.assignment)
    if sample_ids is None:
        sample_ids = make_sample_ids(dispatcher_rank, batch_index * gb, gb)
    union = replicated_union(batch, replicated, feature_tables)
    order = np.concatenate(step_plan.assignment).astype(np.int64, copy=False)
    wstart = np.zeros(W + 1, np.int64)
    np.cumsum([a.shape[0] for a in step_plan.assignment], out=wstart[1:])
    parts = build_parts(batch, order, wstart)
    labels, dense, ids = batch.labels[order], batch.dense[order], sample_ids[order]
    plans = step_plan.plans
    mbs, frames = [], []
    for rank in range(W):
        lo, hi = int(wstart[rank]), int(wstart[rank + 1])
        early = early_pulls(plans[rank].pull, touched_before) if reads_early else None  # None: all False
        mb = MicroBatch(
            step, rank, ids[lo:hi], labels[lo:hi], dense[lo:hi], *parts[rank], plans[rank], union, early, next_follows
        )
        mbs.append(mb)
        frames.append(wire.pack(*mb.to_frames()))
    ready = ReadyStep(step, batch_index, mbs, frames, np.asarray(step_plan.counts), schedule_ms, sample_ids)
    return ready, touched_keys(plans) if reads_early else None


def scheduled_view(batch: SampleBatch, replicated: tuple[int, ...]) -> SampleBatch:
    """``batch`` with the ``replicated`` features (those reading replicated tables) emptied:
    the scheduler never sees their keys (every worker holds them; docs/design.md, "Replicated tables")."""
    if not replicated:
        return batch
    empty_values, empty_offsets = np.zeros(0, np.uint64), np.zeros(len(batch) + 1, np.int64)
    values = [empty_values if t in replicated else v for t, v in enumerate(batch.values)]
    offsets = [empty_offsets if t in replicated else o for t, o in enumerate(batch.offsets)]
    return SampleBatch(batch.labels, batch.dense, values, offsets, batch.table_names, validate=False)
