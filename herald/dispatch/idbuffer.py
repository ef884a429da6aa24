"""The ID-feature buffer of in-flight samples, keyed by sample id (Persia §4.2.1)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from herald.contracts.microbatch import MicroBatch
from herald.errors import ProtocolError


@dataclasses.dataclass
class Resolved:
    """Where some in-flight samples are (:meth:`IdFeatureBuffer.resolve`).

    Attributes:
        step: int64 [n], the step each sample was handed out in.
        rank: int32 [n], the worker it went to.
        index: int64 [n], its row in that worker's micro-batch.
    """

    step: np.ndarray
    rank: np.ndarray
    index: np.ndarray


class IdFeatureBuffer:
    """ID features of in-flight samples, keyed by sample id (Persia §4.2.1's buffer).

    Holds the micro-batches of steps sent but not yet acked by every worker; bounded
    by ``capacity_samples`` (the credits keep it from filling: a full buffer is a bug
    and raises rather than growing). :meth:`resolve` finds samples by id (Persia's
    embedding worker returning gradients by sample id: NOTE [hybrid training] in
    herald/dispatch/hybrid.py), :meth:`features` gives their ID features.
    """

    def __init__(self, capacity_samples: int):
        self.capacity_samples = capacity_samples
        self._steps: collections.OrderedDict[int, list[MicroBatch]] = collections.OrderedDict()
        # per step: sample ids sorted, and the (rank, index) of each
        self._index: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.size_samples = 0

    def put(self, step: int, micro_batches: list[MicroBatch]) -> None:
        n = sum(len(mb) for mb in micro_batches)
        if self.size_samples + n > self.capacity_samples:
            raise ProtocolError(f"ID-feature buffer full ({self.size_samples}+{n} > {self.capacity_samples} samples)")
        self._steps[step] = micro_batches
        self.size_samples += n
        ids = np.concatenate([mb.sample_ids for mb in micro_batches]) if micro_batches else np.zeros(0, np.uint64)
        ranks = (
            np.concatenate([np.full(len(mb), mb.rank, np.int32) for mb in micro_batches])
            if micro_batches
            else np.zeros(0, np.int32)
        )
        rows = (
            np.concatenate([np.arange(len(mb), dtype=np.int64) for mb in micro_batches])
            if micro_batches
            else np.zeros(0, np.int64)
        )
        order = np.argsort(ids, kind="stable")
        self._index[step] = (ids[order], ranks[order], rows[order])

    def get(self, sample_id: int) -> tuple[int, dict[int, np.ndarray]]:
        """(rank, {table: ids}) of one in-flight sample.

        Raises:
            KeyError: the sample is not in flight (never sent, or already acked).
        """
        got = self.resolve(np.array([sample_id], np.uint64))
        if got.step[0] < 0:
            raise KeyError(f"sample id {sample_id} is not in flight")
        mb = self.micro_batch(int(got.step[0]), int(got.rank[0]))
        i = int(got.index[0])
        return mb.rank, {t: mb.values(t)[mb.offsets[t][i] : mb.offsets[t][i + 1]] for t in range(mb.num_tables)}

    def resolve(self, sample_ids: np.ndarray, step: int | None = None) -> Resolved:
        """Find in-flight samples by id (uint64 [n]), in every buffered step or only in
        ``step``; a sample not found gets step, rank and index -1. Ids are unique per step
        (NOTE [micro-batch layout]); when several steps hold an id, the newest wins."""
        ids = np.asarray(sample_ids, np.uint64)
        out = Resolved(
            np.full(ids.shape[0], -1, np.int64),
            np.full(ids.shape[0], -1, np.int32),
            np.full(ids.shape[0], -1, np.int64),
        )
        for at_step, (keys, ranks, rows) in self._index.items():
            if not keys.shape[0] or step is not None and at_step != step:
                continue
            at = np.minimum(np.searchsorted(keys, ids), keys.shape[0] - 1)
            hit = keys[at] == ids
            out.step[hit], out.rank[hit], out.index[hit] = at_step, ranks[at[hit]], rows[at[hit]]
        return out

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """Every buffered micro-batch of ``step`` (rank order as handed out).

        Raises:
            KeyError: that step is not in flight.
        """
        return list(self._steps[step])

    def micro_batch(self, step: int, rank: int) -> MicroBatch:
        """The buffered micro-batch of ``rank`` at ``step``.

        Raises:
            KeyError: that step is not in flight.
        """
        for mb in self._steps[step]:
            if mb.rank == rank:
                return mb
        raise KeyError(f"no micro-batch of rank {rank} at step {step}")

    def features(self, step: int, rank: int, index: np.ndarray, table: int) -> tuple[np.ndarray, np.ndarray]:
        """ID features of samples ``index`` (int64 [n]) of ``rank``'s micro-batch at ``step``,
        one table: ``(ids uint64 [nnz], lengths int64 [n])``, sample after sample (a
        jagged array, as in :class:`~herald.loader.batch.SampleBatch`)."""
        mb = self.micro_batch(step, rank)
        offsets = mb.offsets[table]
        starts, ends = offsets[index], offsets[index + 1]
        lengths = (ends - starts).astype(np.int64)
        if not index.shape[0]:
            return np.zeros(0, np.uint64), lengths
        pos = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths) + np.arange(lengths.sum())
        return mb.values(table)[pos], lengths

    def release(self, step: int) -> None:
        mbs = self._steps.pop(step, [])
        self._index.pop(step, None)
        self.size_samples -= sum(len(mb) for mb in mbs)
