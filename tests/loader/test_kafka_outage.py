"""NOTE [kafka outage] (herald/loader/kafka/outage.py) without a broker: a KafkaSource over a
scripted consumer whose commits and polls fail as a lost broker's do, and a loopback port that
is closed (the broker gone) or listening (back)."""

from __future__ import annotations

import socket
import time
from collections import namedtuple

import kafka.errors as ke
import pytest
from kafka import TopicPartition

from herald.errors import ProtocolError, SourceLost
from herald.loader.kafka.config import KafkaPosition
from herald.loader.kafka.outage import consumer_window_ms
from herald.loader.kafka.source import KafkaSource, KafkaSourceConfig

Record = namedtuple("Record", "offset value")
LINE = b"1\t" + b"\t".join([b"1"] * 13) + b"\t" + b"\t".join([b"68fd1e64"] * 26)
TOPIC = "clicks"


class Broker:
    """A loopback port that accepts connections while ``up`` (the source's reachability check)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.listen(16)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def down(self) -> None:
        self.sock.close()

    def up(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(16)


class Consumer:
    """A KafkaConsumer stand-in: ``commits`` is a list of what each commit does (an exception
    to raise, or None: accepted), ``polls`` what each poll returns (a list of records or an
    exception; empty when exhausted); ``on_poll`` runs at each poll."""

    config = {"session_timeout_ms": 1000, "request_timeout_ms": 500}

    def __init__(self, commits=(), polls=(), on_poll=None):
        self.commits, self.polls, self.on_poll = list(commits), list(polls), on_poll
        self.committed_offsets, self.poll_calls = [], 0

    def poll(self, timeout_ms=0):
        time.sleep(timeout_ms / 1000)  # a poll that gets nothing waits its timeout
        self.poll_calls += 1
        if self.on_poll is not None:
            self.on_poll(self)
        item = self.polls.pop(0) if self.polls else []
        if isinstance(item, BaseException):
            raise item
        return {TopicPartition(TOPIC, 0): item} if item else {}

    def commit(self, offsets, timeout_ms=None):
        item = self.commits.pop(0) if self.commits else None
        if item is not None:
            raise item
        self.committed_offsets.append({tp.partition: m.offset for tp, m in offsets.items()})

    def committed(self, tp, metadata=False, timeout_ms=None):
        return None

    def assignment(self):
        return {TopicPartition(TOPIC, 0)}

    def pause(self, tp):
        pass

    def close(self, **kw):
        pass


def make_source(broker, consumer, **kw):
    cfg = KafkaSourceConfig(
        broker.bootstrap, TOPIC, "g", "tsv", partitions=(0,), poll_timeout_ms=20, connect_timeout_ms=200, **kw
    )
    src = KafkaSource(cfg, consumer=consumer)
    notices = []
    src.outage.notice = notices.append
    return src, notices


@pytest.fixture
def broker():
    b = Broker()
    yield b
    b.sock.close()


POSITION = KafkaPosition(TOPIC, {0: (7, 0)})


def test_a_commit_that_reaches_no_broker_is_retried_and_goes_through(broker):
    consumer = Consumer(commits=[ke.KafkaConnectionError("111 ECONNREFUSED"), ke.KafkaTimeoutError(), None])
    src, notices = make_source(broker, consumer, outage_timeout_ms=30_000)
    src.commit(POSITION)
    assert consumer.committed_offsets == [{0: 7}]
    assert consumer.poll_calls >= 2  # the consumer is polled between attempts (reconnect, heartbeats)
    assert len(notices) == 2 and "lost" in notices[0] and broker.bootstrap in notices[0] and TOPIC in notices[0]
    assert "back after" in notices[1]
    assert src.outage.count == 1


def test_a_group_that_forgot_the_member_is_rejoined_and_the_commit_repeated(broker):
    consumer = Consumer(commits=[ke.CommitFailedError(ke.IllegalGenerationError()), None])
    src, _ = make_source(broker, consumer, outage_timeout_ms=30_000)
    src.commit(POSITION)
    assert consumer.committed_offsets == [{0: 7}] and consumer.poll_calls >= 1


def test_a_commit_past_the_window_names_broker_topic_offsets_and_the_resume(broker):
    consumer = Consumer(commits=[None] + [ke.KafkaConnectionError("111 ECONNREFUSED")] * 10_000)
    src, notices = make_source(broker, consumer, outage_timeout_ms=300)
    src.commit(KafkaPosition(TOPIC, {0: (5, 3)}))  # the last commit that went through
    src.outage.resume_hint = "run it again with --resume"
    with pytest.raises(SourceLost) as info:
        src.commit(POSITION)
    message = str(info.value)
    assert broker.bootstrap in message and repr(TOPIC) in message and "outage_timeout_ms=300" in message
    assert "partition 0: offset 5 (skip 3)" in message and message.endswith("run it again with --resume")
    assert info.value.committed == {0: (5, 3)} and info.value.topic == TOPIC
    assert "rebalance" not in message
    assert len(notices) == 1  # the start of the outage; it never ended


def test_a_commit_the_broker_refuses_for_another_reason_fails_at_once_without_the_rebalance_hint(broker):
    consumer = Consumer(commits=[ke.GroupAuthorizationFailedError()])
    src, notices = make_source(broker, consumer, outage_timeout_ms=30_000)
    with pytest.raises(ProtocolError) as info:
        src.commit(POSITION)
    assert "rebalance" not in str(info.value) and "GroupAuthorizationFailed" in str(info.value)
    assert not notices


def test_a_read_waits_for_a_lost_broker_and_reads_on_when_it_is_back(broker):
    """Unbounded stream: quiet for connect_timeout_ms, the broker's port refuses (an outage, not
    an error), then it listens again and the records come."""
    state = {"polls": 0}

    def script(consumer):
        if state["polls"] == 0:
            broker.down()
        if src.outage.since is not None:  # the outage has begun: a few polls more, then back
            state["polls"] += 1
            if state["polls"] == 5:
                broker.up()
                consumer.polls = [[Record(0, LINE), Record(1, LINE)]]
        state["polls"] = max(state["polls"], 0)

    consumer = Consumer(on_poll=script)
    src, notices = make_source(broker, consumer, outage_timeout_ms=30_000)
    batch = src.read(10)
    assert batch is not None and len(batch) == 2
    assert len(notices) == 2 and "lost (connect" in notices[0] and "back after" in notices[1]


def test_a_read_past_the_window_raises_source_lost_not_the_end_of_data(broker):
    """A bounded stream (idle_timeout_ms) whose broker is gone does not end as if the data had."""
    broker.down()
    src, notices = make_source(broker, Consumer(), outage_timeout_ms=400, idle_timeout_ms=100)
    with pytest.raises(SourceLost) as info:
        src.read(10)
    assert "none (nothing committed yet)" in str(info.value) and broker.bootstrap in str(info.value)
    assert len(notices) == 1


def test_a_poll_that_reaches_no_broker_is_an_outage_and_the_window_defaults_to_the_consumers_timeouts(broker):
    consumer = Consumer(polls=[ke.NodeNotReadyError(0), [Record(0, LINE)]])
    src, notices = make_source(broker, consumer)
    assert src.read(10) is not None and len(notices) == 2
    assert src.outage.window_ms == consumer_window_ms(consumer) == 1500
