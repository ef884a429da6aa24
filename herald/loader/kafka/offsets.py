"""The Kafka source's calls to the brokers, each bounded and each failure named: connecting
the consumer, the group's committed positions, the end offsets and commits (NOTE [kafka
position] in :mod:`herald.loader.kafka.source`)."""

from __future__ import annotations

import time
from types import MappingProxyType

import kafka.errors as ke
from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition

from herald.errors import ConfigError, ProtocolError
from herald.loader.kafka.config import (
    META_PREFIX,
    KafkaPosition,
    KafkaSourceConfig,
    broker_timeout,
    check_reachable,
    no_broker_errors,
    timeout_kw,
)

_NO_BROKERS = no_broker_errors()

# Consumer defaults the caller's client_options may override.
# metadata_max_age_ms: a topic created after the consumer subscribed (trainer started
# before the producer) is found within seconds, not kafka-python's default 5 minutes.
# reconnect_backoff_max_ms: a broker back from an outage (NOTE [kafka outage]) is dialled
# again within a second, not after kafka-python's backoff of up to 30 s (measured: a
# 40 s outage was read on 31 s after the broker returned).
CLIENT_DEFAULTS = {
    "max_poll_records": 10000,
    "fetch_max_wait_ms": 100,
    "auto_offset_reset": "earliest",
    "metadata_max_age_ms": 2000,
    "reconnect_backoff_max_ms": 1000,
}


def connect(config: KafkaSourceConfig, listener: ConsumerRebalanceListener):
    """A ``KafkaConsumer`` (no auto commit) subscribed to the topic with ``listener`` (group
    mode, ``partitions=None``) or assigned ``config.partitions`` (not yet positioned).

    Raises:
        PeerTimeout: no broker reachable or answering. ConfigError: kafka-python refused
            ``client_options``.
    """
    opts = {**CLIENT_DEFAULTS, **config.client_options}
    check_reachable(config.bootstrap_servers, config.connect_timeout_ms)
    try:
        consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap_servers.split(","),
            group_id=config.group_id,
            enable_auto_commit=False,
            **opts,
        )
    except _NO_BROKERS as exc:
        raise broker_timeout(
            config.bootstrap_servers,
            "bootstrap",
            f"no Kafka broker answered at {config.bootstrap_servers}; check the address "
            "and that client_options['api_version'] matches the broker (e.g. (0, 9))",
        ) from exc
    except ke.KafkaConfigurationError as exc:
        raise ConfigError(f"kafka-python rejected client_options: {exc}") from exc
    if config.partitions is None:
        consumer.subscribe([config.topic], listener=listener)
    else:
        consumer.assign([TopicPartition(config.topic, p) for p in config.partitions])
    return consumer


def committed(consumer, tp, config: KafkaSourceConfig) -> tuple[int, int] | None:
    """The group's committed ``(offset, skip)`` of partition ``tp``, or None without a commit.

    Raises:
        PeerTimeout: the group coordinator did not answer within ``commit_timeout_ms``.
    """
    try:
        meta = consumer.committed(tp, metadata=True, **timeout_kw(consumer.committed, config.commit_timeout_ms))
    except ke.KafkaTimeoutError as exc:
        raise broker_timeout(
            config.bootstrap_servers,
            "committed",
            f"group coordinator of {config.bootstrap_servers} did not return the "
            f"committed offset of {tp} within {config.commit_timeout_ms} ms",
        ) from exc
    if meta is None or meta.offset is None or meta.offset < 0:
        return None
    skip = 0
    if meta.metadata and meta.metadata.startswith(META_PREFIX):
        skip = int(meta.metadata[len(META_PREFIX) :] or 0)
    return int(meta.offset), skip


def committed_position(consumer, config: KafkaSourceConfig, partitions) -> KafkaPosition:
    """The group's committed position of ``partitions`` (ints; those without a commit left out).

    Raises:
        PeerTimeout: the group coordinator did not answer within ``commit_timeout_ms``.
    """
    out = {}
    for p in partitions:
        c = committed(consumer, TopicPartition(config.topic, p), config)
        if c is not None:
            out[p] = c
    return KafkaPosition(config.topic, MappingProxyType(out))


def records_left(consumer, config: KafkaSourceConfig, positions: dict[int, int]) -> list[tuple[int, int, int]]:
    """``[(partition, position, end offset)]`` of the topic's partitions with records after
    ``positions`` (partition -> next offset; a partition not in it: the group's committed
    offset); NOTE [kafka assignment].

    Raises:
        PeerTimeout: the brokers did not answer within ``commit_timeout_ms``. ProtocolError:
            they refused the lookup.
    """
    positions = dict(positions)
    try:
        for p in consumer.partitions_for_topic(config.topic) or ():
            if p not in positions and (config.partitions is None or p in config.partitions):
                done = committed(consumer, TopicPartition(config.topic, p), config)
                if done is not None:
                    positions[p] = done[0]
        if not positions:
            return []
        tps = [TopicPartition(config.topic, p) for p in sorted(positions)]
        ends = consumer.end_offsets(tps, **timeout_kw(consumer.end_offsets, config.commit_timeout_ms))
    except ke.KafkaTimeoutError as exc:
        raise broker_timeout(
            config.bootstrap_servers,
            "end_offsets",
            f"{config.source_name}: the brokers did not return the end offsets within {config.commit_timeout_ms} ms",
        ) from exc
    except ke.KafkaError as exc:
        raise ProtocolError(f"{config.source_name}: end offsets lookup failed: {exc!r}") from exc
    return [
        (tp.partition, positions[tp.partition], int(ends[tp]))
        for tp in tps
        if ends.get(tp) is not None and int(ends[tp]) > positions[tp.partition]
    ]


class CommitRefused(ProtocolError):
    """The group refused a commit because this consumer must rejoin it first (a rebalance,
    or a restarted broker that forgot the member): rejoin (``poll``), then commit again."""


def commit(consumer, config: KafkaSourceConfig, position: KafkaPosition, timeout_ms: int | None = None) -> None:
    """Commit ``position`` to the group, synchronously (nothing when it holds no partition).

    ``timeout_ms``: the bound on this call (default ``commit_timeout_ms``).

    Raises:
        ConfigError: a position of another topic. PeerTimeout: no broker acknowledged within
            the bound, or none could be reached (NOTE [kafka outage]: retry). CommitRefused:
            the group asks this consumer to rejoin first. ProtocolError: the broker refused
            the commit for another reason.
    """
    if position.topic != config.topic:
        raise ConfigError(f"position is for topic {position.topic!r}, this source reads {config.topic!r}")
    if not position.offsets:
        return
    bound = config.commit_timeout_ms if timeout_ms is None else timeout_ms
    try:
        consumer.commit(position.to_commit(), **timeout_kw(consumer.commit, bound))
    except ke.CommitFailedError as exc:
        raise CommitRefused(
            f"commit to {config.source_name} refused: {exc!r}; the group (group {config.group_id!r}) "
            "rebalanced or its broker restarted: rejoin it and commit again"
        ) from exc
    except ke.KafkaError as exc:
        if isinstance(exc, ke.KafkaTimeoutError):
            what = f"not acknowledged within {bound} ms"
        elif is_outage(exc):
            what = f"reached no broker ({exc!r})"
        else:
            raise ProtocolError(
                f"commit to {config.source_name} (group {config.group_id!r}) refused by the broker: {exc!r}; "
                "check the group's permissions and the broker's log"
            ) from exc
        raise broker_timeout(config.bootstrap_servers, "commit", f"commit to {config.source_name} {what}") from exc


def stream_lag(consumer, positions: dict[int, tuple[int, int]], stamps_ms: dict[int, int]) -> dict:
    """NOTE [lag] in herald/loader/kafka/source.py, from what ``consumer`` already knows (no
    request): ``records`` (partition -> records between ``positions`` (partition -> (offset,
    skip)) and the log end its last fetch reported; partitions without one are left out) and
    ``event_time_s`` (float s from the newest read record's timestamp, ``stamps_ms``
    partition -> ms (-1: none), to now: the largest over the partitions behind; None without
    any)."""
    now_ms = time.time() * 1000
    records: dict[int, int] = {}
    behind_s: list[float] = []
    for tp in sorted(consumer.assignment(), key=lambda t: t.partition):
        end, pos = consumer.highwater(tp), positions.get(tp.partition)
        if end is None or pos is None:
            continue
        records[tp.partition] = max(0, int(end) - pos[0])
        stamp = stamps_ms.get(tp.partition)
        if stamp is not None and stamp >= 0:
            behind_s.append(max(0.0, now_ms - stamp) / 1000 if records[tp.partition] else 0.0)
    return {"records": records, "event_time_s": max(behind_s) if behind_s else None}


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` (a kafka-python error) means no broker answered, so a retry may
    succeed (NOTE [kafka outage] in herald/loader/kafka/outage.py)."""
    return isinstance(exc, (*_NO_BROKERS, ke.KafkaTimeoutError)) or bool(getattr(exc, "retriable", False))
