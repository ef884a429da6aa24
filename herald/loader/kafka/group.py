"""The Kafka source's membership of its consumer group (NOTE [kafka assignment] in
:mod:`herald.loader.kafka.source`): since when it waits for an assignment, the bound on
that wait, the partitions assigned and not yet positioned, and when data (or a join)
last arrived. :class:`GroupMembership` is also the consumer's rebalance listener."""

from __future__ import annotations

import time
from collections.abc import Callable

from kafka import ConsumerRebalanceListener

from herald.loader.kafka import offsets
from herald.loader.kafka.config import ASSIGNMENT_MARGIN_MS, KafkaSourceConfig, broker_timeout, check_reachable


class GroupMembership(ConsumerRebalanceListener):
    """One source's group membership (manual ``partitions``: never waiting).

    Args:
        config: the source's settings. on_revoked: called with the partition numbers (a
            set of ints) a rebalance took away, to drop what was fetched from them.

    Attributes:
        unassigned_since: ``time.monotonic()`` since this member waits for an assignment,
            None when assigned (or with manual partitions).
        last_data: ``time.monotonic()`` of the last records or assignment (idle time counts from it).
        consumer: the consumer whose session timeout bounds the wait (set by the source).
    """

    def __init__(self, config: KafkaSourceConfig, on_revoked: Callable[[set[int]], None]) -> None:
        self.config = config
        self.on_revoked = on_revoked
        self.unassigned_since: float | None = time.monotonic() if config.partitions is None else None
        self.last_data = time.monotonic()
        self.consumer = None
        self._started: set = set()  # assigned partitions (TopicPartitions) not yet positioned

    def session_timeout_ms(self) -> int:
        """The consumer's effective session timeout: the caller's option, else what
        kafka-python chose for the broker version (its coordinator's config)."""
        if "session_timeout_ms" in self.config.client_options:
            return int(self.config.client_options["session_timeout_ms"])
        for owner in (getattr(self.consumer, "_coordinator", None), self.consumer):
            value = (getattr(owner, "config", None) or {}).get("session_timeout_ms")
            if isinstance(value, int):
                return value
        return 45_000

    @property
    def assignment_timeout_ms(self) -> int:
        """The bound on the wait for a group assignment (NOTE [kafka assignment])."""
        if self.config.assignment_timeout_ms is not None:
            return self.config.assignment_timeout_ms
        return self.session_timeout_ms() + ASSIGNMENT_MARGIN_MS

    def awaiting_assignment(self) -> bool:
        """True while this group member has no assignment yet.

        Raises:
            PeerTimeout: past :attr:`assignment_timeout_ms` (naming brokers, group and topic).
        """
        since = self.unassigned_since
        if since is None:
            return False
        waited_ms = (time.monotonic() - since) * 1000
        bound = self.assignment_timeout_ms
        if waited_ms < bound:
            return True
        cfg = self.config
        check_reachable(cfg.bootstrap_servers, cfg.connect_timeout_ms)
        raise broker_timeout(
            cfg.bootstrap_servers,
            "join_group",
            f"{cfg.source_name}: consumer group {cfg.group_id!r} assigned this consumer no "
            f"partitions of topic {cfg.topic!r} within {bound} ms (assignment_timeout_ms; the session "
            f"timeout is {self.session_timeout_ms()} ms). A consumer of a crashed run holds its partitions until "
            "its session times out, and the group waits for every member to rejoin: check that no other "
            "consumer of the group is stuck, then retry, or raise assignment_timeout_ms",
        )

    def check_end_of_data(self, positions: dict[int, int]) -> None:
        """At the idle end of a source that delivered nothing: raise if records are left after
        ``positions`` (partition -> next offset; else the group's committed offset).

        Raises:
            PeerTimeout: records are left (another live member holds those partitions).
        """
        left = offsets.records_left(self.consumer, self.config, positions)
        if not left:
            return
        cfg = self.config
        what = ", ".join(f"partition {p}: offsets {pos}..{end - 1}" for p, pos, end in left)
        raise broker_timeout(
            cfg.bootstrap_servers,
            "fetch",
            f"{cfg.source_name}: no record arrived within idle_timeout_ms={cfg.idle_timeout_ms} "
            f"although records are left after this consumer's position ({what}; group "
            f"{cfg.group_id!r}), so this is not the end of the data. Another live member of the group "
            "holds those partitions: after a crash its consumer stays a member until its session times out "
            f"({self.session_timeout_ms()} ms): wait that long and run --resume again; if another job reads "
            "with the same group, give this one its own group (group=...), or raise idle_timeout_ms",
        )

    def take_started(self) -> set:
        """The partitions assigned since the last call (TopicPartitions), to position now."""
        started, self._started = self._started, set()
        return started

    # ------------------------------------------------------------- listener
    def on_partitions_revoked(self, revoked) -> None:
        if self.unassigned_since is None:  # NOTE [kafka assignment]: a rebalance began
            self.unassigned_since = time.monotonic()
        self.on_revoked({tp.partition for tp in revoked})

    def on_partitions_assigned(self, assigned) -> None:
        # Runs on kafka-python's IO thread, where blocking calls (committed()) are refused:
        # the source starts these partitions after poll() returns (take_started).
        self._started.update(assigned)
        self.last_data = time.monotonic()  # idle time counts from here
        self.unassigned_since = None  # NOTE [kafka assignment] (maybe none assigned)
