"""Kafka topic -> SampleBatch, with a per-partition position committed only on request.

NOTE [kafka position]: the position of a partition is ``(offset, skip)``: the next
record to read and how many of its samples were already delivered (``skip > 0``
only inside an ``arrow`` record, which holds many samples). After every ``read()``
the source's position covers exactly the rows returned so far, in every partition
(``last_read_position``). Nothing is committed automatically
(``enable_auto_commit=False``): the dispatcher calls ``commit(position)`` with the
position of the last batch whose samples are fully trained, so a restart re-delivers
every sample not yet trained and none that was (``skip`` travels in the commit
metadata as ``herald:skip=N``). On start the consumer resumes from the group's
committed positions, or from ``auto_offset_reset`` (``earliest``) without one;
``load_state_dict`` overrides both.

Record formats (a setting, never guessed): ``tsv`` one Criteo line per message,
``csv`` one Avazu line per message, ``arrow`` one Arrow IPC stream (a record batch
of many samples, :mod:`herald.loader.formats.arrow` layout) per message. Bad records follow
NOTE [bad records] (:mod:`herald.loader.policy`); Kafka adds the reasons
``bad_arrow`` (unreadable payload) and ``schema_mismatch``.

NOTE [kafka assignment]: in group mode (``partitions=None``) a consumer reads nothing
until the group coordinator assigns it partitions, and a consumer of a crashed run
(``kill -9``) stays a member, holding its partitions, until its session times out
(``session_timeout_ms``: 30 s for kafka-python 3 against a broker older than 3.0).
So the source first waits for its assignment, without counting idle time, for at most
``assignment_timeout_ms`` (default: the session timeout + ``ASSIGNMENT_MARGIN_MS``),
then raises :class:`~herald.errors.PeerTimeout` naming the brokers, group and topic;
the idle timeout (end of data) and an ``arrow`` topic's ``schema_timeout_ms`` count
only from the assignment on (again after every revocation). At the idle end of a source
that delivered nothing since it started (or since ``load_state_dict``), the end
offsets are compared with its position (else the group's committed one): records left
there mean this consumer was not given them (another live member of the group holds
the partition), not the end of data, and raise :class:`PeerTimeout` saying what to do.

A broker lost mid-stream is waited for within a bounded window: NOTE [kafka outage] in
:mod:`herald.loader.kafka.outage`. A rejoin after a rebalance resumes each partition at
the later of this source's own position (rows delivered) and the group's committed one:
what was delivered is trained by this job and committed with its next checkpoint.

NOTE [lag]: how far the job is behind the stream, from what the consumer already knows
(no request of its own): ``records`` per partition, the log end the last fetch reported
(``KafkaConsumer.highwater``) minus the read position (a record partly read counts as
behind; a Kafka source is read in the dispatcher's thread without prefetch, so the read
position is that of the global batch just cut);
``event_time_s``, now minus the timestamp of the newest record read, the largest over the
partitions that are behind (a partition read to its end is 0 s behind, however old its
last record; None when the broker gives no timestamps, as 0.9 does). :meth:`KafkaSource.lag`
is sampled after every global batch (:class:`~herald.loader.global_batches.GlobalBatches`);
the progress bar shows it and the report gives it over the job.

Clients must talk the broker's protocol: pass ``client_options={"api_version": (0, 9)}``
for a 0.9 broker (the test broker, :mod:`herald.loader.kafka.broker`).
"""

from __future__ import annotations

import threading
import time
from types import MappingProxyType

import kafka.errors as ke
import numpy as np
from kafka import TopicPartition

from herald.errors import DataError, ProtocolError
from herald.loader.batch import SampleBatch, Schema
from herald.loader.kafka import offsets
from herald.loader.kafka.config import (
    KafkaPosition,
    KafkaSourceConfig,
    config_from_url,
    known_client_options,
    timeout_kw,
)
from herald.loader.kafka.group import GroupMembership
from herald.loader.kafka.outage import BrokerOutage, consumer_window_ms
from herald.loader.kafka.records import Chunk, make_decoder
from herald.loader.source import Source

__all__ = ["KafkaPosition", "KafkaSource", "KafkaSourceConfig", "config_from_url", "known_client_options", "open_kafka"]


class KafkaSource(Source):
    """Samples from a Kafka topic (see NOTE [kafka position] for offsets and commits).

    Args:
        config: :class:`KafkaSourceConfig`.
        consumer: a ready ``KafkaConsumer``-like object (tests); default: build one.

    Raises:
        ConfigError: invalid settings. PeerTimeout: no broker reachable at
        ``bootstrap_servers`` within ``connect_timeout_ms`` at start; no group assignment
        within ``assignment_timeout_ms``; records left after the position of a source that
        delivered nothing (NOTE [kafka assignment]). SourceLost: a broker lost later (found
        at the idle end of data, every ``connect_timeout_ms`` without records in unbounded
        mode, or by a commit) did not answer again within ``outage_timeout_ms`` (NOTE
        [kafka outage]).

    Attributes:
        outage: the brokers' outages (:class:`~herald.loader.kafka.outage.BrokerOutage`: its
            ``resume_hint`` ends a :class:`~herald.errors.SourceLost`'s message, ``herald
            train`` names its ``--resume`` command there; ``count``, ``total_s``).
    """

    format_name = "kafka"

    def __init__(self, config: KafkaSourceConfig, *, consumer=None) -> None:
        super().__init__()
        self.config = config
        self._decoder = make_decoder(config.format, config.bucket_count)
        self._chunks: list[Chunk] = []
        self._next: dict[int, tuple[int, int]] = {}  # partition -> position of delivered rows
        self._resume: dict[int, tuple[int, int]] = {}  # partition -> position to skip to
        self._skipped_counts: dict[str, int] = {}
        self._error: DataError | None = None
        self._interrupted = threading.Event()
        # NOTE [kafka assignment]: the wait for an assignment, the consumer's rebalance listener
        self._group = GroupMembership(config, self._drop_partitions)
        # NOTE [kafka outage]: a lost broker is waited for within its window
        self.outage = BrokerOutage(config, lambda: consumer_window_ms(self._consumer))
        self._delivered = 0  # rows returned since start / load_state_dict
        self._event_ms: dict[int, int] = {}  # partition -> timestamp of its newest record read (NOTE [lag])
        self.last_read_position = KafkaPosition(config.topic, MappingProxyType({}))
        self.last_read_records = (np.zeros(0, np.int32), np.zeros(0, np.int64))
        self.last_read_rows = np.zeros(0, np.int64)
        self._consumer = consumer if consumer is not None else self._connect()
        self._group.consumer = self._consumer
        self._group.last_data = time.monotonic()
        self._next_check_ms = config.connect_timeout_ms  # quiet time before the next liveness check

    # ------------------------------------------------------------- assignment
    @property
    def assignment_timeout_ms(self) -> int:
        """The bound on the wait for a group assignment (NOTE [kafka assignment])."""
        return self._group.assignment_timeout_ms

    def _drop_partitions(self, gone: set[int]) -> None:
        """A rebalance took the partitions ``gone`` away: drop what was fetched from them (their
        delivered position stays in ``_next``: a rejoin resumes from it, NOTE [kafka position])."""
        self._chunks = [c for c in self._chunks if c.partition not in gone]

    # ------------------------------------------------------------- connection
    def _connect(self):
        consumer = offsets.connect(self.config, self._group)
        if self.config.partitions is not None:
            for p in self.config.partitions:
                self._start_partition(consumer, TopicPartition(self.config.topic, p))
        return consumer

    def _start_partition(self, consumer, tp, first_offset: int | None = None) -> bool:
        """Seek ``tp`` to its resume position: ``load_state_dict``'s, else the group's commit.

        ``first_offset`` is the offset of the first record already fetched for ``tp``
        (group mode), if any. Returns True when the consumer was moved elsewhere, so
        those fetched records must be dropped (they come again from the new position).
        """
        p = tp.partition
        if p not in self._resume:
            committed = offsets.committed(consumer, tp, self.config)
            if committed is not None:
                self.outage.committed[p] = committed
            # a rejoin: rows delivered up to _next[p] are this job's to train and commit
            known = [pos for pos in (committed, self._next.get(p)) if pos is not None]
            if not known:
                return False  # auto_offset_reset decides; fetched records are right
            self._resume[p] = max(known)
        self._next[p] = self._resume[p]
        if first_offset == self._resume[p][0]:
            return False
        consumer.seek(tp, self._resume[p][0])
        return first_offset is not None

    # --------------------------------------------------------------- reading
    @property
    def schema(self) -> Schema:
        """Criteo/Avazu columns for ``tsv``/``csv``; for ``arrow`` those of the first message
        (waits up to ``schema_timeout_ms``; raises DataError if none arrives)."""
        if self._decoder.schema is None:
            deadline = None  # counts from the group assignment on (NOTE [kafka assignment])
            while self._decoder.schema is None and not self._error:
                if self._group.awaiting_assignment():
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + self.config.schema_timeout_ms / 1000
                elif time.monotonic() >= deadline:
                    break
                self._poll(min(self.config.poll_timeout_ms, self.config.schema_timeout_ms))
            if self._decoder.schema is None:
                raise DataError(
                    f"no readable Arrow message within schema_timeout_ms="
                    f"{self.config.schema_timeout_ms}; produce to the topic first or raise "
                    "the timeout",
                    source=self.config.source_name,
                )
        return self._decoder.schema

    @property
    def position(self) -> KafkaPosition:
        """The current position (same as ``last_read_position`` between reads)."""
        return KafkaPosition(self.config.topic, MappingProxyType(dict(self._next)))

    # NOTE: after each read(), ``last_read_position`` (a KafkaPosition: where to resume once
    # this batch and all before it are trained; pass it to commit()) and ``last_read_records``
    # (partition int32 [B], offset int64 [B]: the record each returned row came from) and
    # ``last_read_rows`` (int64 [B]: each row's index inside its record, bad rows counted)
    # describe the batch just returned.

    def interrupt(self) -> None:
        """Make a blocked ``read()`` return None at its next poll (thread-safe)."""
        self._interrupted.set()

    def _read(self, max_rows: int) -> SampleBatch | None:
        # Idle time counts only while this read waits: time the caller spent between
        # reads (training, checkpointing) is not a quiet topic.
        waiting_since = time.monotonic()
        while not any(c.remaining for c in self._chunks):
            self._drain_empty()
            if self._error is not None:
                raise self._error
            if self._interrupted.is_set():
                return None
            if self._group.awaiting_assignment():  # NOTE [kafka assignment]: not idle yet
                waiting_since = time.monotonic()
                self._poll(self.config.poll_timeout_ms)
                continue
            idle = self.config.idle_timeout_ms
            quiet_ms = (time.monotonic() - max(self._group.last_data, waiting_since)) * 1000
            check = self.outage.since is not None or quiet_ms >= self._next_check_ms
            if check or (idle is not None and quiet_ms >= idle):
                if not self.outage.reachable(self._group):  # NOTE [kafka outage]: not the end of data
                    self._poll(self.config.poll_timeout_ms)
                    continue
                quiet_ms = (time.monotonic() - max(self._group.last_data, waiting_since)) * 1000
                self._next_check_ms = quiet_ms + self.config.connect_timeout_ms
            if idle is not None and quiet_ms >= idle:
                if not self._delivered:  # records left for another member are not the end
                    self._group.check_end_of_data({p: off for p, (off, _) in self._next.items()})
                return None  # end of data, not a dead broker
            self._poll(self.config.poll_timeout_ms if idle is None else max(1, min(self.config.poll_timeout_ms, idle)))
        parts, partitions, at, rows, need = [], [], [], [], max_rows
        while need and self._chunks:
            chunk = self._chunks[0]
            take = min(need, chunk.remaining)
            if take:
                parts.append(chunk.batch.slice(chunk.cursor, chunk.cursor + take))
                partitions.append(np.full(take, chunk.partition, np.int32))
                at.append(chunk.offsets[chunk.cursor : chunk.cursor + take])
                rows.append(chunk.rows[chunk.cursor : chunk.cursor + take])
                chunk.cursor += take
                need -= take
                self._event_ms[chunk.partition] = max(chunk.delivered_ms(), self._event_ms.get(chunk.partition, -1))
                self._advance(chunk, chunk.position_after(chunk.cursor))
            if chunk.remaining == 0:
                self._finish(self._chunks.pop(0))
        self.last_read_position = self.position
        self.last_read_records = (np.concatenate(partitions), np.concatenate(at))
        self._delivered += int(self.last_read_records[1].shape[0])
        self.last_read_rows = np.concatenate(rows)
        return SampleBatch.concat(parts)

    def _drain_empty(self) -> None:
        while self._chunks and self._chunks[0].remaining == 0:
            self._finish(self._chunks.pop(0))

    def _finish(self, chunk: Chunk) -> None:
        """A drained chunk: move to its end (past trailing bad records); strict raises at its bad one."""
        self._advance(chunk, chunk.end)
        if self.config.bad_records == "strict" and chunk.bad_reasons and self._error is None:
            self._error = chunk.first_bad_error(self.config.format, self.config.source_name)

    def _advance(self, chunk: Chunk, position: tuple[int, int]) -> None:
        self._next[chunk.partition] = position
        if self.config.bad_records == "skip":
            n = chunk.bad_before(position)
            for reason in chunk.bad_reasons[chunk.bad_counted : n]:
                self._skipped_counts[reason] = self._skipped_counts.get(reason, 0) + 1
            chunk.bad_counted = max(n, chunk.bad_counted)

    def _poll(self, timeout_ms: int) -> None:
        try:
            polled = self._consumer.poll(timeout_ms=timeout_ms)
        except ke.KafkaError as exc:
            if not offsets.is_outage(exc):
                raise ProtocolError(f"Kafka poll from {self.config.source_name} failed: {exc!r}") from exc
            self.outage.lost("poll", repr(exc))  # NOTE [kafka outage]: SourceLost past its window
            return
        starting = self._group.take_started()
        moved = {
            tp
            for tp in starting
            if self._start_partition(self._consumer, tp, polled[tp][0].offset if polled.get(tp) else None)
        }
        if starting or any(polled.values()):
            self.outage.back()
            self._group.last_data = time.monotonic()  # joining the group is activity, not idleness
            self._next_check_ms = self.config.connect_timeout_ms
        for tp in sorted(polled, key=lambda t: t.partition):
            records = polled[tp]
            if not records or tp in moved:
                continue  # the partition was moved: its records come again
            at = np.fromiter((r.offset for r in records), np.int64, len(records))
            chunk = self._decoder.decode(tp.partition, at, [r.value for r in records])
            chunk.record_at, chunk.record_ms = at, _timestamps_ms(records)  # NOTE [lag]
            resume = self._resume.get(tp.partition)
            if resume is not None:
                chunk = chunk.drop_before(resume)
                if chunk.end[0] > resume[0]:
                    del self._resume[tp.partition]
            if self.config.bad_records == "strict":
                chunk = chunk.truncate_at_first_bad()
            self._chunks.append(chunk)
            if self.config.bad_records == "strict" and chunk.bad_reasons:
                # Stop fetching this partition past the bad record: the error ends the read.
                self._consumer.pause(tp)

    # -------------------------------------------------------------- commits
    def commit(self, position: KafkaPosition | None = None) -> None:
        """Commit ``position`` (default: ``last_read_position``: call it once all its samples
        are trained) to the group, synchronously, retrying a lost broker or a rejoin within
        ``outage_timeout_ms`` (:meth:`BrokerOutage.commit`, NOTE [kafka outage]).

        Raises:
            SourceLost: no commit went through within the window. ProtocolError: refused.
        """
        self.outage.commit(self._consumer, self.last_read_position if position is None else position, self._poll)

    def committed(self) -> KafkaPosition:
        """The group's committed position for this source's partitions (blocking, bounded)."""
        parts = self.config.partitions
        if parts is None:
            parts = tuple(sorted(tp.partition for tp in self._consumer.assignment())) or tuple(self._next)
        return offsets.committed_position(self._consumer, self.config, parts)

    # ---------------------------------------------------------------- state
    @property
    def stats(self) -> dict:
        return {**super().stats, "position": self.position.to_dict()["positions"]}

    def _skipped(self) -> dict:
        return self._skipped_counts

    def _get_state(self) -> dict:
        return {**self.position.to_dict(), "skipped": dict(self._skipped_counts)}

    def lag(self) -> dict | None:
        """NOTE [lag] (:func:`~herald.loader.kafka.offsets.stream_lag`); from the reading thread only."""
        return offsets.stream_lag(self._consumer, dict(self._next), dict(self._event_ms))

    def _set_state(self, state: dict) -> None:
        pos = KafkaPosition.from_dict(state)
        if pos.topic != self.config.topic:
            raise DataError(f"state is for topic {pos.topic!r}, this source reads {self.config.topic!r}")
        skipped = state.get("skipped", {})
        if not isinstance(skipped, dict):
            raise DataError(f"malformed kafka state: 'skipped' must map reason -> count, got {skipped!r}")
        self._chunks.clear()
        self._error = None
        self._delivered = 0
        self._skipped_counts = dict(skipped)
        self._resume = dict(pos.offsets)
        self._next = dict(pos.offsets)
        assigned = {tp.partition: tp for tp in self._consumer.assignment()}
        for p, (off, _) in pos.offsets.items():
            if p in assigned:
                self._consumer.seek(assigned[p], off)
                self._consumer.resume(assigned[p])
        self.last_read_position = self.position

    def close(self, timeout_s: float = 5.0) -> None:
        """Leave the group and close the connection within ``close_timeout_ms`` and
        ``timeout_s``, the smaller; idempotent.

        Never commits: uncommitted samples are re-delivered to the group.
        """
        if not self._closed and self._consumer is not None:
            bound_ms = max(0, min(self.config.close_timeout_ms, int(timeout_s * 1000)))
            try:
                self._consumer.close(autocommit=False, **timeout_kw(self._consumer.close, bound_ms))
            except Exception:  # noqa: BLE001 - closing must not raise over a dead broker
                pass
        super().close(timeout_s)


def _timestamps_ms(records) -> np.ndarray:
    """int64 [r]: each polled record's timestamp in ms (-1 where the broker gives none)."""
    stamps = (getattr(r, "timestamp", None) for r in records)
    return np.fromiter((t if t is not None and t >= 0 else -1 for t in stamps), np.int64, len(records))


def open_kafka(spec: str, **options) -> KafkaSource:
    """``open_source`` factory for ``kafka://`` URLs (see :func:`config_from_url`)."""
    return KafkaSource(config_from_url(spec, **options))
