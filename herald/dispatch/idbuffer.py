"""The ID-feature buffer of in-flight samples, keyed by sample id (Persia §4.2.1)."""

from __future__ import annotations

import collections

import numpy as np

from herald.errors import ProtocolError
from herald.dispatch.microbatch import MicroBatch


class IdFeatureBuffer:
    """ID features of in-flight samples, keyed by sample id (Persia §4.2.1's buffer).

    Holds the micro-batches of steps sent but not yet acked by every worker; bounded
    by ``capacity_samples`` (the credits keep it from filling: a full buffer is a bug
    and raises rather than growing).
    """

    def __init__(self, capacity_samples: int):
        self.capacity_samples = capacity_samples
        self._steps: "collections.OrderedDict[int, list[MicroBatch]]" = collections.OrderedDict()
        self.size_samples = 0

    def put(self, step: int, micro_batches: list[MicroBatch]) -> None:
        n = sum(len(mb) for mb in micro_batches)
        if self.size_samples + n > self.capacity_samples:
            raise ProtocolError(f"ID-feature buffer full ({self.size_samples}+{n} > {self.capacity_samples} samples)")
        self._steps[step] = micro_batches
        self.size_samples += n

    def get(self, sample_id: int) -> tuple[int, dict[int, np.ndarray]]:
        """(rank, {table: ids}) of one in-flight sample.

        Raises:
            KeyError: the sample is not in flight (never sent, or already acked).
        """
        for mbs in self._steps.values():
            for mb in mbs:
                hit = np.flatnonzero(mb.sample_ids == np.uint64(sample_id))
                if hit.size:
                    i = int(hit[0])
                    return mb.rank, {t: mb.values(t)[mb.offsets[t][i]:mb.offsets[t][i + 1]]
                                     for t in range(mb.num_tables)}
        raise KeyError(f"sample id {sample_id} is not in flight")

    def release(self, step: int) -> None:
        mbs = self._steps.pop(step, [])
        self.size_samples -= sum(len(mb) for mb in mbs)
