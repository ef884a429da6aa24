"""A lost Kafka broker, waited for within a bounded window (NOTE [kafka outage]).

NOTE [kafka outage]: a broker that stops answering (killed, restarting, a network cut)
is an outage of the job's input, not a failure of the job. The source's reads and its
commits treat a broker they cannot reach (a refused or timed-out connection, a
coordinator that is not available, kafka-python's timeout) the same way: the first such
failure starts the outage (one line on stderr, in the progress output: brokers, topic,
what failed, how long it is waited for), the call is retried (the consumer reconnects by
itself, every ``reconnect_backoff_max_ms`` at most) and the first call that succeeds
ends it (one line: how long it lasted). A commit that fails because the restarted
broker forgot this consumer's group membership rejoins the group and commits again:
the position committed is still that of trained samples, so delivery stays at least
once (NOTE [kafka delivery] in herald/loader/global_batches.py), and a rejoin resumes
each partition at the later of this source's own position and the group's committed
one (NOTE [kafka position]), so nothing read is read twice. An outage longer than the
window (``outage_timeout_ms``; None: the consumer's ``session_timeout_ms`` +
``request_timeout_ms``, the longest it waits itself for a rejoin and for one request)
raises :class:`~herald.errors.SourceLost`, naming the brokers, the topic, the last
committed offsets and how to resume (``resume_hint``; ``herald train`` sets its
``--resume`` command). Errors that are no outage (a broker that refuses the request
for another reason) raise at once, as before.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from herald.errors import PeerTimeout, SourceLost
from herald.loader.kafka import offsets
from herald.loader.kafka.config import KafkaPosition, KafkaSourceConfig, check_reachable

#: the outage window's default when the consumer's settings cannot be read (ms)
DEFAULT_WINDOW_MS = 60_000


def consumer_window_ms(consumer) -> int:
    """The consumer's ``session_timeout_ms`` + ``request_timeout_ms`` (kafka-python's config
    dict; :data:`DEFAULT_WINDOW_MS` when it has none)."""
    config = getattr(consumer, "config", None) or {}
    session, request = config.get("session_timeout_ms"), config.get("request_timeout_ms")
    if isinstance(session, int) and isinstance(request, int):
        return session + request
    return DEFAULT_WINDOW_MS


def _stderr(line: str) -> None:
    tqdm.write(line, file=sys.stderr)  # on its own line, above a progress bar if one is shown


class BrokerOutage:
    """One source's view of its brokers' outages (NOTE [kafka outage]).

    Args:
        config: the source's settings (``outage_timeout_ms``: the window).
        default_window_ms: ``default_window_ms()`` -> the window when ``outage_timeout_ms``
            is None (the consumer's own timeouts: :func:`consumer_window_ms`).
        notice: where the outage's start and end lines go (default: stderr).

    Attributes:
        since: ``time.monotonic()`` of the outage's start, None while the brokers answer.
        committed: ``{partition: (offset, skip)}``: the group's committed positions as the
            source last knew them (its start's lookups, its own commits).
        resume_hint: how to go on after an outage past the window (the error's last words).
        count, total_s: outages so far and their time (seconds) in all.
    """

    def __init__(
        self,
        config: KafkaSourceConfig,
        default_window_ms: Callable[[], int],
        notice: Callable[[str], None] = _stderr,
    ) -> None:
        self.config = config
        self._default_window_ms = default_window_ms
        self.notice = notice
        self.since: float | None = None
        self.committed: dict[int, tuple[int, int]] = {}
        self.resume_hint = (
            f"start the broker again, then read on from the committed offsets (group {config.group_id!r})"
        )
        self.count, self.total_s = 0, 0.0
        self._last = ""

    @property
    def window_ms(self) -> int:
        """The longest outage waited for (ms)."""
        if self.config.outage_timeout_ms is not None:
            return int(self.config.outage_timeout_ms)
        return int(self._default_window_ms())

    def remaining_ms(self) -> int:
        """What is left of the window (ms, >= 1; the whole window outside an outage)."""
        if self.since is None:
            return self.window_ms
        return max(1, int(self.window_ms - (time.monotonic() - self.since) * 1000))

    def lost(self, op: str, error: str) -> None:
        """The call ``op`` (``"commit"``, ``"poll"``, ``"connect"``) found no broker (``error``):
        start the outage (one line on stderr) or go on with it.

        Raises:
            SourceLost: the outage has lasted the whole window.
        """
        now = time.monotonic()
        self._last = f"{op}: {error}"
        if self.since is None:
            self.since, self.count = now, self.count + 1
            self.notice(
                f"herald: kafka: broker {self.config.bootstrap_servers} lost ({self._last}); topic "
                f"{self.config.topic!r}: reads and commits wait up to {self.window_ms / 1000:.0f} s for it "
                "(outage_timeout_ms)"
            )
        lasted_ms = (now - self.since) * 1000
        if lasted_ms >= self.window_ms:
            raise SourceLost(
                f"{self.config.source_name}: the Kafka broker {self.config.bootstrap_servers} stayed unreachable "
                f"for {lasted_ms / 1000:.1f} s, past the outage window (outage_timeout_ms={self.window_ms}; last "
                f"failure: {self._last}); topic {self.config.topic!r}, group {self.config.group_id!r}; last "
                f"committed offsets: {self.describe_committed()}. To go on: {self.resume_hint}",
                peer=self.config.bootstrap_servers,
                op=op,
                topic=self.config.topic,
                committed=self.committed,
            )

    def back(self) -> None:
        """A call to the brokers succeeded: end the outage, if any (one line on stderr)."""
        if self.since is None:
            return
        lasted = time.monotonic() - self.since
        self.since, self.total_s = None, self.total_s + lasted
        self.notice(
            f"herald: kafka: broker {self.config.bootstrap_servers} back after {lasted:.1f} s; "
            f"topic {self.config.topic!r} read on"
        )

    def reachable(self, group) -> bool:
        """Whether a broker accepts a TCP connection: False starts or goes on with an outage
        (SourceLost past the window); its end counts as activity of ``group`` (the source's
        :class:`~herald.loader.kafka.group.GroupMembership`), so the quiet time of an outage
        is not read as the end of the data."""
        cfg = self.config
        try:
            check_reachable(cfg.bootstrap_servers, min(cfg.connect_timeout_ms, self.remaining_ms()))
        except PeerTimeout as exc:
            self.lost("connect", str(exc))
            return False
        if self.since is not None:
            self.back()
            group.last_data = time.monotonic()
        return True

    def commit(self, consumer, position: KafkaPosition, poll: Callable[[int], None]) -> None:
        """Commit ``position`` through ``consumer``, retrying within the window: each attempt
        bounded by ``commit_timeout_ms``, ``poll(timeout_ms)`` between attempts (the consumer
        reconnects, rejoins and heartbeats there).

        Raises:
            SourceLost: no attempt went through within the window. ProtocolError: the broker
                refused the commit for another reason.
        """
        while True:
            bound = min(self.config.commit_timeout_ms, self.remaining_ms())
            try:
                offsets.commit(consumer, self.config, position, timeout_ms=bound)
            except (PeerTimeout, offsets.CommitRefused) as exc:
                self.lost("commit", str(exc))  # raises SourceLost past the window
                poll(min(self.config.poll_timeout_ms, self.remaining_ms()))
                continue
            self.back()
            self.committed.update(position.offsets)
            return

    def describe_committed(self) -> str:
        """The last committed offsets in words (``partition 0: offset 40``, ``skip N`` inside a message)."""
        if not self.committed:
            return "none (nothing committed yet)"
        return ", ".join(
            f"partition {p}: offset {o}" + (f" (skip {s})" if s else "") for p, (o, s) in sorted(self.committed.items())
        )
