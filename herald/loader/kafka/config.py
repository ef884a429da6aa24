"""Settings and position of the Kafka source: :class:`KafkaSourceConfig`, :class:`KafkaPosition`
and ``kafka://`` URL parsing (NOTE [kafka position] in :mod:`herald.loader.kafka.source`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from herald.config import parse_value, require
from herald.errors import ConfigError, DataError, PeerTimeout
from herald.loader.kafka.records import FORMATS
from herald.loader.policy import POLICIES

# Set by the source itself; a client option naming one of these raises.
_RESERVED = ("bootstrap_servers", "group_id", "enable_auto_commit", "key_deserializer", "value_deserializer")
#: commit metadata carrying a position's skip (NOTE [kafka position]): ``herald:skip=N``
META_PREFIX = "herald:skip="
#: Added to the consumer's session timeout to bound the wait for a group assignment
#: (NOTE [kafka assignment]): coordinator lookup, join and sync round trips.
ASSIGNMENT_MARGIN_MS = 10_000


def known_client_options() -> frozenset[str]:
    """kafka-python ``KafkaConsumer`` settings that ``client_options`` may set."""
    from kafka import KafkaConsumer

    return frozenset(KafkaConsumer.DEFAULT_CONFIG) - frozenset(_RESERVED)


def no_broker_errors() -> tuple[type[Exception], ...]:
    """kafka-python's "no broker answered" errors (``NoBrokersAvailable`` is gone from 3.x,
    ``KafkaConnectionError`` is in both)."""
    import kafka.errors as ke

    return tuple(e for e in (getattr(ke, "NoBrokersAvailable", None), ke.KafkaConnectionError) if e is not None)


def broker_timeout(bootstrap_servers: str, op: str, message: str) -> PeerTimeout:
    """The :class:`PeerTimeout` of a Kafka call ``op`` (``"commit"``, ``"fetch"``, ...) that
    the brokers ``bootstrap_servers`` (its peer) did not answer; ``message`` names the fix."""
    return PeerTimeout(message, peer=bootstrap_servers, op=op)


def check_reachable(bootstrap_servers: str, timeout_ms: int) -> None:
    """Raise PeerTimeout unless one of ``host:port[,host:port]`` accepts a TCP connection in ``timeout_ms``.

    kafka-python waits silently (an empty poll, a metadata wait of minutes) when no
    broker is there; this bounded check turns that into an error naming the peer.
    """
    import socket
    import time

    deadline = time.monotonic() + timeout_ms / 1000
    errors = []
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection(
                (host.strip("[]") or "localhost", int(port)), timeout=max(0.05, deadline - time.monotonic())
            ):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{server}: {exc}")
    raise broker_timeout(
        bootstrap_servers,
        "connect",
        f"no Kafka broker reachable at {bootstrap_servers} within {timeout_ms} ms "
        f"({'; '.join(errors)}); start the broker or fix the address",
    )


@dataclasses.dataclass(frozen=True)
class KafkaSourceConfig:
    """Settings of a :class:`KafkaSource`.

    Args:
        bootstrap_servers: ``"host:port"`` or several, comma-separated.
        topic: the topic to read.
        group_id: consumer group; committed positions are kept per group.
        format: ``"tsv"`` (Criteo lines), ``"csv"`` (Avazu lines) or ``"arrow"``.
        partitions: read exactly these partitions (manual assignment, no rebalancing;
            e.g. one subset per dispatcher), or None to join the group and read the
            partitions the group coordinator assigns.
        client_options: extra kafka-python ``KafkaConsumer`` settings (``api_version``,
            ``security_protocol``, ``ssl_*``, ``sasl_*``, ``max_poll_records``, ...).
            Unknown keys and the keys the source sets itself raise.
        poll_timeout_ms: longest single wait for records (ms, >= 1).
        idle_timeout_ms: end of data after this long without records (ms); None =
            unbounded stream: ``read()`` keeps polling until records come or
            :meth:`KafkaSource.interrupt` is called.
        bad_records: ``"strict"`` (raise DataError) or ``"skip"`` (drop and count).
        bucket_count: reduce hashed ids of ``tsv``/``csv`` modulo this (0 = full 64-bit ids).
        schema_timeout_ms: how long ``schema`` of an ``arrow`` topic waits for the first message.
        commit_timeout_ms: longest wait for a commit or a committed-offset lookup (ms).
        connect_timeout_ms: bound on the TCP reachability check of the brokers, done at
            start and whenever no record came for this long (ms).
        close_timeout_ms: bound on ``close()`` (ms).
        assignment_timeout_ms: group mode: longest wait for the group's partition
            assignment (NOTE [kafka assignment]); idle time counts only after it. None:
            the consumer's ``session_timeout_ms`` plus :data:`ASSIGNMENT_MARGIN_MS` (a
            crashed run's consumer holds its partitions until its session times out).
        outage_timeout_ms: how long reads and commits wait for a lost broker (NOTE [kafka
            outage] in :mod:`herald.loader.kafka.outage`) before raising
            :class:`~herald.errors.SourceLost`; None: the consumer's ``session_timeout_ms``
            + ``request_timeout_ms``.

    Raises:
        ConfigError: a value out of range or an unknown/reserved client option.
    """

    bootstrap_servers: str
    topic: str
    group_id: str
    format: str
    partitions: tuple[int, ...] | None = None
    client_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    poll_timeout_ms: int = 500
    idle_timeout_ms: int | None = None
    bad_records: str = "strict"
    bucket_count: int = 0
    schema_timeout_ms: int = 30000
    commit_timeout_ms: int = 10000
    connect_timeout_ms: int = 10000
    close_timeout_ms: int = 5000
    assignment_timeout_ms: int | None = None
    outage_timeout_ms: int | None = None

    def __post_init__(self) -> None:
        require(bool(self.bootstrap_servers), "bootstrap_servers must name at least one host:port")
        require(bool(self.topic), "topic must be a non-empty string")
        require(bool(self.group_id), "group_id must be a non-empty string: committed positions are per group")
        require(
            self.format in FORMATS,
            f"format must be one of {sorted(FORMATS)} (a setting, never guessed), got {self.format!r}",
        )
        require(self.bad_records in POLICIES, f"bad_records must be one of {POLICIES}, got {self.bad_records!r}")
        if self.partitions is not None:
            parts = tuple(int(p) for p in self.partitions)
            require(
                len(parts) > 0 and min(parts) >= 0 and len(set(parts)) == len(parts),
                f"partitions must be distinct ints >= 0 (or None for group assignment), got {self.partitions}",
            )
            object.__setattr__(self, "partitions", parts)
        for name in (
            "poll_timeout_ms",
            "schema_timeout_ms",
            "commit_timeout_ms",
            "connect_timeout_ms",
            "close_timeout_ms",
        ):
            require(int(getattr(self, name)) >= 1, f"{name} must be >= 1 ms, got {getattr(self, name)}")
        for name in ("assignment_timeout_ms", "outage_timeout_ms"):
            value = getattr(self, name)
            require(
                value is None or int(value) >= 1,
                f"{name} must be >= 1 ms or None (the consumer's own timeouts), got {value}",
            )
        require(
            self.idle_timeout_ms is None or self.idle_timeout_ms >= 1,
            f"idle_timeout_ms must be >= 1 ms or None (unbounded), got {self.idle_timeout_ms}",
        )
        require(self.bucket_count >= 0, f"bucket_count must be >= 0, got {self.bucket_count}")
        opts = dict(self.client_options)
        reserved = sorted(set(opts) & set(_RESERVED))
        require(
            not reserved,
            f"client_options {reserved} are set by KafkaSource itself; use the "
            "KafkaSourceConfig fields (commits are explicit: KafkaSource.commit)",
        )
        unknown = sorted(set(opts) - known_client_options())
        require(
            not unknown, f"unknown kafka-python consumer option(s) {unknown}; known: {sorted(known_client_options())}"
        )
        if isinstance(opts.get("api_version"), list):
            opts["api_version"] = tuple(opts["api_version"])
        object.__setattr__(self, "client_options", MappingProxyType(opts))

    @property
    def source_name(self) -> str:
        return f"kafka://{self.bootstrap_servers}/{self.topic}"


@dataclasses.dataclass(frozen=True)
class KafkaPosition:
    """Per-partition position (NOTE [kafka position]): ``partition -> (next offset, skip)``.

    ``to_commit()`` gives the kafka-python ``{TopicPartition: OffsetAndMetadata}`` map.
    """

    topic: str
    offsets: Mapping[int, tuple[int, int]]

    def to_dict(self) -> dict:
        """JSON form: ``{"topic": ..., "positions": {"0": [offset, skip], ...}}``."""
        return {
            "topic": self.topic,
            "positions": {str(p): [int(o), int(s)] for p, (o, s) in sorted(self.offsets.items())},
        }

    @classmethod
    def from_dict(cls, state: dict) -> KafkaPosition:
        """Inverse of :meth:`to_dict`. Raises DataError on a malformed state."""
        topic, positions = state.get("topic"), state.get("positions")
        if not isinstance(topic, str) or not isinstance(positions, dict):
            raise DataError(f"malformed kafka state: need 'topic' (str) and 'positions' (dict), got {state!r}")
        offsets = {}
        for p, v in positions.items():
            ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and x >= 0 for x in v)
            if not (str(p).isdigit() and ok):
                raise DataError(
                    f"malformed kafka state: position of partition {p!r} must be [offset, skip] ints >= 0, got {v!r}"
                )
            offsets[int(p)] = (int(v[0]), int(v[1]))
        return cls(topic, MappingProxyType(offsets))

    def to_commit(self) -> dict:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        # kafka-python >= 2.1 adds leader_epoch (-1 = unknown) to OffsetAndMetadata.
        extra = (-1,) if "leader_epoch" in OffsetAndMetadata._fields else ()
        return {
            TopicPartition(self.topic, p): OffsetAndMetadata(o, f"{META_PREFIX}{s}" if s else "", *extra)
            for p, (o, s) in self.offsets.items()
        }


def timeout_kw(method, timeout_ms: int) -> dict:
    """``{"timeout_ms": timeout_ms}`` if the kafka-python ``method`` takes it (3.x), else ``{}``
    (2.0.x: the call is bounded by the client's ``request_timeout_ms``)."""
    import inspect

    try:
        return {"timeout_ms": timeout_ms} if "timeout_ms" in inspect.signature(method).parameters else {}
    except (TypeError, ValueError):
        return {}


# ------------------------------------------------------------------ kafka:// URLs
_URL_ALIASES = {"group": "group_id", "bad": "bad_records"}
_INT_FIELDS = (
    "poll_timeout_ms",
    "idle_timeout_ms",
    "bucket_count",
    "schema_timeout_ms",
    "commit_timeout_ms",
    "connect_timeout_ms",
    "close_timeout_ms",
    "assignment_timeout_ms",
    "outage_timeout_ms",
)


def parse_kafka_value(key: str, value: Any) -> Any:
    """A text value (URL query, ``KEY=VALUE`` option) as the type kafka-python / the
    config expects: ``api_version=0.9`` -> ``(0, 9)``, ``partitions=0,1`` -> ``(0, 1)``,
    anything else by :func:`herald.config.parse_value`.

    Raises:
        ValueError: a malformed ``api_version`` or ``partitions``.
    """
    if not isinstance(value, str):
        return value
    if key == "api_version":
        return tuple(int(x) for x in value.replace(",", ".").split("."))
    if key == "partitions":
        return tuple(int(x) for x in value.split(",") if x != "")
    if key in ("assignment_timeout_ms", "outage_timeout_ms") and value.lower() in ("", "none"):
        return None
    if key == "idle_timeout_ms" and value.lower() in ("", "none", "inf"):
        return None
    return parse_value(value)


def config_from_url(spec: str, **options) -> KafkaSourceConfig:
    """Parse ``kafka://HOST:PORT[,HOST:PORT]/TOPIC?format=arrow&group=G[&...]``.

    Query keys (and keyword ``options``, which win) are :class:`KafkaSourceConfig`
    fields (``group`` is short for ``group_id``, ``bad`` for ``bad_records``;
    ``partitions=0,1``) or kafka-python consumer settings, which go to
    ``client_options`` (``api_version=0.9``, ``security_protocol=SSL``, ...).

    Raises:
        ConfigError: no host or topic, or an unknown key.
    """
    import urllib.parse

    url = urllib.parse.urlparse(spec)
    topic = url.path.lstrip("/")
    if url.scheme != "kafka" or not url.netloc or not topic or "/" in topic:
        raise ConfigError(f"expected kafka://HOST:PORT/TOPIC?format=...&group=..., got {spec!r}")
    raw = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
    raw.update(options)
    fields = {f.name for f in dataclasses.fields(KafkaSourceConfig)} - {"bootstrap_servers", "topic"}
    settings: dict[str, Any] = {"bootstrap_servers": url.netloc, "topic": topic}
    client = dict(raw.pop("client_options", None) or {})
    unknown = []
    for key, value in raw.items():
        key = _URL_ALIASES.get(key, key)
        try:
            parsed = parse_kafka_value(key, value)
        except ValueError as exc:
            raise ConfigError(f"kafka URL option {key}={value!r}: {exc}") from exc
        if key in fields:
            settings[key] = parsed
        elif key in known_client_options():
            client[key] = parsed
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(
            f"unknown kafka option(s) {sorted(unknown)}; known: {sorted(fields | set(_URL_ALIASES))} "
            "and the kafka-python consumer settings (client_options)"
        )
    for key in ("format", "group_id"):
        if key not in settings:
            raise ConfigError(
                f"kafka source needs {key}= ({'tsv, csv or arrow' if key == 'format' else 'a consumer group'}"
                f"): kafka://HOST:PORT/TOPIC?format=arrow&group=NAME, got {spec!r}"
            )
    for key in _INT_FIELDS:
        if isinstance(settings.get(key), str):
            raise ConfigError(f"{key} must be an integer, got {settings[key]!r}")
    return KafkaSourceConfig(client_options=client, **settings)
