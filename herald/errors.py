"""The error hierarchy. Every message names the fix.

``HeraldError`` is the root; ``retriable`` tells a caller whether repeating the
same call may succeed (as in kafka-python's ``kafka.errors``).
"""

from __future__ import annotations


class HeraldError(Exception):
    """Root of every error herald raises on purpose."""

    retriable = False


class ConfigError(HeraldError, ValueError):
    """A setting is unknown, out of range, or inconsistent with another setting."""


class UsageError(ConfigError):
    """Invalid command-line options, found after parsing (two options that contradict each
    other, a value checked against the host): exit status 2, as argparse's own usage
    errors; nothing was started (NOTE [front doors] in herald/inputs.py)."""

    exit_code = 2


class DataError(HeraldError, ValueError):
    """Input data is malformed. Carries where (``source``, ``position``) and why (``reason``).

    Args:
        message: human-readable description, naming the fix.
        source: file path, topic/partition or other source name.
        position: line number (1-based), row index or offset within ``source``.
        reason: a short machine-readable reason (e.g. ``"field_count"``).
    """

    def __init__(
        self, message: str, *, source: str | None = None, position: int | None = None, reason: str | None = None
    ):
        where = ""
        if source is not None:
            where = f" [{source}" + (f":{position}" if position is not None else "") + "]"
        super().__init__(message + where)
        self.source = source
        self.position = position
        self.reason = reason


class PeerTimeout(HeraldError, TimeoutError):
    """A network peer did not answer within its timeout. The message names the peer."""

    retriable = True

    def __init__(self, message: str, *, peer: str | None = None, op: str | None = None):
        super().__init__(message)
        self.peer = peer
        self.op = op


class PeerLost(HeraldError):
    """A peer process is known to have ended: its supervisor saw it exit (NOTE [death
    notices] in herald/deaths.py). The message names the peer, how it ended (its signal) and
    the end of its log; ``peer``: its address, ``op``: what was waited on, ``unix_s``: when
    the death was seen (Unix seconds; None: unknown)."""

    def __init__(self, message: str, *, peer: str | None = None, op: str | None = None, unix_s: float | None = None):
        super().__init__(message)
        self.peer, self.op, self.unix_s = peer, op, unix_s


class SourceLost(PeerTimeout):
    """The job's data source (a Kafka broker) stayed unreachable past its outage window
    (NOTE [kafka outage] in herald/loader/kafka/outage.py): the dispatcher's own input
    failed, so the workers that stop with it are not the cause. The message names the
    brokers, the topic, the last committed offsets and how to resume.

    Attributes:
        topic: the topic read. committed: ``{partition: (offset, skip)}``, the group's
            committed positions as the source last knew them (empty: none).
    """

    retriable = False

    def __init__(self, message: str, *, peer: str, op: str, topic: str, committed: dict[int, tuple[int, int]]):
        super().__init__(message, peer=peer, op=op)
        self.topic = topic
        self.committed = dict(committed)


class ProtocolError(HeraldError):
    """A message on the wire broke the protocol (bad header, sizes, unknown op or table)."""


class StorageError(HeraldError):
    """A file or folder could not be written (disk full, permission denied, read-only file
    system, ...): NOTE [private files] in herald/files.py. The message names the path, why
    and the fix.

    Args:
        message: human-readable description, naming the fix.
        path: the file or folder that could not be written.
        errno: the ``OSError``'s errno, or None when the cause is not an ``OSError``.
    """

    def __init__(self, message: str, *, path: str, errno: int | None = None):
        super().__init__(message)
        self.path = path
        self.errno = errno
