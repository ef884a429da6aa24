"""What a shard's op handlers share: :class:`ShardContext` (and the job's state in it).

A handler (herald/ps/handler.py) is given the context, never the server: the store and
tables it reads and writes, the limits it enforces, the counters it reports in ``stats``,
the part parser that checks its requests, and what the shard knows of the job.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

from herald.ps.config import ShardLimits
from herald.ps.parts import PartParser
from herald.ps.replies import error_reply
from herald.ps.store import TableSet

#: Steps whose pushing ranks are remembered (to name the missing ones of an aborted step).
PUSHER_STEPS = 256


@dataclasses.dataclass
class JobState:
    """What a shard knows of the job it serves.

    Attributes:
        max_contributors: NOTE [ps limits]' bound on ``contributors`` and ``rank``.
        workers: the job's worker count, once a declare carried it (bounds contributors and ranks).
        aborted: reports of the last aborted aggregations (NOTE [ps aggregation]).
    """

    max_contributors: int
    workers: int | None = None
    aborted: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=16))
    _pushers: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    @property
    def contributor_bound(self) -> int:
        """Largest ``contributors`` value accepted, and the bound on ``rank`` (NOTE [ps limits])."""
        return min(self.max_contributors, self.workers or self.max_contributors)

    def bound_name(self) -> str:
        """What :attr:`contributor_bound` is, for an error message."""
        if self.workers is not None and self.workers <= self.max_contributors:
            return f"the job's {self.workers} workers (declared)"
        return f"this shard's max_contributors={self.max_contributors} (--max-contributors)"

    def pushed(self, step: int, rank: int) -> None:
        """Remember that ``rank`` pushed ``step`` (to name the missing ranks of an abort)."""
        ranks = self._pushers.setdefault(step, set())
        ranks.add(rank)
        self._pushers.move_to_end(step)
        while len(self._pushers) > PUSHER_STEPS:
            self._pushers.popitem(last=False)

    def ranks_pushed(self, step: int) -> list[int]:
        """The ranks that pushed ``step``, ascending (of the last :data:`PUSHER_STEPS` steps)."""
        return sorted(self._pushers.get(step, ()))


@dataclasses.dataclass
class ShardContext:
    """The parts of one shard its op handlers use.

    Attributes:
        shard, num_shards, seed: the shard's position and the job's seed.
        limits: NOTE [ps limits].
        store: every table's arrays and the open aggregations (:class:`~herald.ps.store.TableSet`).
        tables: the declared :class:`~herald.ps.table.EmbeddingTable` s, by index.
        counters: what ``stats`` reports under ``counters``.
        parts: checks a request's parts (:class:`~herald.ps.parts.PartParser`).
        job: :class:`JobState`.
    """

    shard: int
    num_shards: int
    seed: int
    limits: ShardLimits
    store: TableSet
    tables: list
    counters: collections.Counter
    parts: PartParser
    job: JobState

    def error_reply(self, op: object, rid: int, exc: BaseException) -> list:
        """The error reply frames of request ``rid`` that failed with ``exc`` (counted)."""
        return error_reply(self.counters, op, rid, exc)

    def log(self, message: str) -> None:
        """One line in the shard's log (stderr), naming the shard."""
        print(f"herald ps shard {self.shard}/{self.num_shards}: {message}", file=sys.stderr, flush=True)
