"""Publish a dataset into a Kafka topic (``herald produce``), in the formats the Kafka source reads.

- ``arrow``: any loader source (:func:`herald.loader.registry.open_source`) is read in
  batches of ``rows_per_message`` samples; each batch becomes one Arrow IPC stream
  (NOTE [arrow layout] in :mod:`herald.loader.formats.arrow`) in one message. A message
  larger than ``max_message_bytes`` is split in halves until it fits.
- ``tsv`` / ``csv``: raw Criteo / Avazu lines, one per message, byte for byte as in
  the file (the Avazu header line is not published). Only a raw file of that format
  can be published this way: other sources (Parquet, synthetic, MovieLens, ...) have
  no Criteo/Avazu text form and raise ConfigError naming ``arrow``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from herald.config import require
from herald.errors import ConfigError, DataError
from herald.loader.batch import SampleBatch
from herald.loader.formats.arrow import batch_to_arrow
from herald.loader.kafka.config import broker_timeout, check_reachable, no_broker_errors
from herald.loader.registry import infer_format, open_source

_RESERVED = ("bootstrap_servers", "key_serializer", "value_serializer")
_TEXT_FORMATS = {"tsv": "criteo", "csv": "avazu"}


@dataclasses.dataclass(frozen=True)
class ProduceSettings:
    """Args:
    bootstrap_servers: ``host:port[,host:port]``. topic: target topic.
    format: ``arrow``, ``tsv`` (Criteo lines) or ``csv`` (Avazu lines).
    rows_per_message: samples per Arrow message (``arrow`` only).
    rate_samples_per_s: throttle to this many samples per second (None = as fast as possible).
    limit_rows: publish at most this many samples (None = all).
    client_options: extra kafka-python ``KafkaProducer`` settings (``api_version``, ...).
    max_message_bytes: largest Arrow message (the broker's ``message.max.bytes``,
        1,000,012 by default).
    flush_timeout_ms: bound on the final flush and close.
    """

    bootstrap_servers: str
    topic: str
    format: str = "arrow"
    rows_per_message: int = 1024
    rate_samples_per_s: float | None = None
    limit_rows: int | None = None
    client_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_message_bytes: int = 1_000_000
    flush_timeout_ms: int = 60_000

    def __post_init__(self) -> None:
        from kafka import KafkaProducer

        require(self.format in ("arrow", *_TEXT_FORMATS), f"format must be arrow, tsv or csv, got {self.format!r}")
        require(self.rows_per_message >= 1, f"rows_per_message must be >= 1, got {self.rows_per_message}")
        require(
            self.rate_samples_per_s is None or self.rate_samples_per_s > 0,
            f"rate_samples_per_s must be > 0 or None, got {self.rate_samples_per_s}",
        )
        require(self.limit_rows is None or self.limit_rows >= 0, f"limit_rows must be >= 0, got {self.limit_rows}")
        require(self.max_message_bytes >= 1024, f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        require(self.flush_timeout_ms >= 1, f"flush_timeout_ms must be >= 1, got {self.flush_timeout_ms}")
        opts = dict(self.client_options)
        bad = sorted(set(opts) & set(_RESERVED))
        require(not bad, f"client_options {bad} are set by herald produce itself")
        unknown = sorted(set(opts) - set(KafkaProducer.DEFAULT_CONFIG))
        require(
            not unknown,
            f"unknown kafka-python producer option(s) {unknown}; known: "
            f"{sorted(set(KafkaProducer.DEFAULT_CONFIG) - set(_RESERVED))}",
        )
        object.__setattr__(self, "client_options", dict(opts))


def arrow_messages(batch: SampleBatch, multi_hot=frozenset(), max_bytes: int = 1_000_000) -> list[tuple[bytes, int]]:
    """``batch`` as ``(Arrow IPC stream payload, samples in it)`` pairs of at most ``max_bytes``
    each (halving the batch as needed), in order.

    Raises:
        ConfigError: a single sample is larger than ``max_bytes``.
    """
    import pyarrow as pa

    record = batch_to_arrow(batch, multi_hot)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, record.schema) as writer:
        writer.write_batch(record)
    payload = sink.getvalue().to_pybytes()
    if len(payload) <= max_bytes:
        return [(payload, len(batch))]
    if len(batch) == 1:
        raise ConfigError(
            f"one sample is {len(payload)} bytes as Arrow, over max_message_bytes={max_bytes}; "
            "raise the broker's message.max.bytes and max_message_bytes"
        )
    half = len(batch) // 2
    return arrow_messages(batch.slice(0, half), multi_hot, max_bytes) + arrow_messages(
        batch.slice(half, len(batch)), multi_hot, max_bytes
    )


def text_lines(path: str, fmt: str, limit_rows: int | None) -> Iterator[bytes]:
    """The raw lines of a Criteo (``tsv``) or Avazu (``csv``) file, without newline or Avazu header."""
    with open(path, "rb") as f:
        n = 0
        for i, line in enumerate(f):
            line = line.rstrip(b"\r\n")
            if i == 0 and fmt == "csv" and line.startswith(b"id,click,"):
                continue
            if limit_rows is not None and n >= limit_rows:
                return
            n += 1
            yield line


def check_text_source(spec: str, fmt: str) -> None:
    """Raise ConfigError unless ``spec`` is a raw text file of ``fmt`` (``tsv``: Criteo, ``csv``: Avazu)."""
    try:
        found = infer_format(spec)
    except ConfigError:
        found = "unknown"
    if found != _TEXT_FORMATS[fmt]:
        raise ConfigError(
            f"format {fmt} publishes raw {_TEXT_FORMATS[fmt]} lines and needs a {_TEXT_FORMATS[fmt]} text file "
            f"as SOURCE; {spec!r} is {found}: use --format arrow to publish any loader source"
        )


class _Throttle:
    def __init__(self, rate: float | None):
        self.rate, self.t0, self.sent = rate, time.monotonic(), 0

    def __call__(self, n: int) -> None:
        self.sent += n
        if self.rate:
            ahead = self.sent / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def produce(
    spec: str,
    settings: ProduceSettings,
    *,
    source_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Publish ``spec`` (a path or URL ``open_source`` accepts) into ``settings.topic``.

    Args:
        spec: the dataset. source_options: options for ``open_source`` (``arrow`` only).
        progress: called with the number of samples after every message.

    Returns:
        ``{"rows": samples, "messages": n, "bytes": payload bytes, "seconds": wall time}``.

    Raises:
        ConfigError: bad settings, or a non-text source with format tsv/csv.
        PeerTimeout: no broker answered, or the final flush did not finish in time.
        DataError: the source is unreadable.
    """
    import kafka.errors as ke

    if settings.format in _TEXT_FORMATS:
        check_text_source(spec, settings.format)
        if source_options:
            raise ConfigError(f"source options {sorted(source_options)} apply to --format arrow only")
    producer = _open_producer(settings)
    t0 = time.monotonic()
    send = _Sender(producer, settings, progress)
    try:
        if settings.format in _TEXT_FORMATS:
            for line in text_lines(spec, settings.format, settings.limit_rows):
                send(line, 1)
        else:
            _produce_arrow(spec, settings, source_options or {}, send)
        producer.flush(timeout=settings.flush_timeout_ms / 1000)
        _settle(send.futures, settings)
    except ke.KafkaTimeoutError as exc:
        raise broker_timeout(
            settings.bootstrap_servers,
            "produce",
            f"Kafka at {settings.bootstrap_servers} did not accept messages within the timeout: {exc}",
        ) from exc
    finally:
        producer.close(timeout=settings.flush_timeout_ms / 1000)
    return {**send.stats, "seconds": time.monotonic() - t0}


def _open_producer(settings: ProduceSettings):
    """A ``KafkaProducer`` for ``settings`` (messages up to ``max_message_bytes``).

    Raises:
        PeerTimeout: no broker reachable or answering.
    """
    import kafka.errors as ke
    from kafka import KafkaProducer

    check_reachable(settings.bootstrap_servers, 10_000)
    opts = {
        "linger_ms": 20,
        "max_block_ms": 30_000,
        "batch_size": 1 << 20,
        "max_request_size": settings.max_message_bytes + 4096,
        **settings.client_options,
    }
    try:
        return KafkaProducer(bootstrap_servers=settings.bootstrap_servers.split(","), **opts)
    except (*no_broker_errors(), ke.KafkaTimeoutError) as exc:
        raise broker_timeout(
            settings.bootstrap_servers,
            "bootstrap",
            f"no Kafka broker answered at {settings.bootstrap_servers}; check the address and "
            "--client-option api_version=0.9 for an old broker",
        ) from exc


class _Sender:
    """``send(payload, rows)``: one message to the topic, counted in :attr:`stats` (rows,
    messages, payload bytes), throttled, acknowledgements settled every 10,000 messages."""

    def __init__(self, producer, settings: ProduceSettings, progress: Callable[[int], None] | None) -> None:
        self.producer, self.settings, self.progress = producer, settings, progress
        self.stats = {"rows": 0, "messages": 0, "bytes": 0}
        self.throttle = _Throttle(settings.rate_samples_per_s)
        self.futures: list = []

    def __call__(self, payload: bytes, rows: int) -> None:
        self.futures.append(self.producer.send(self.settings.topic, payload))
        self.stats["rows"] += rows
        self.stats["messages"] += 1
        self.stats["bytes"] += len(payload)
        if len(self.futures) >= 10000:
            _settle(self.futures, self.settings)
        self.throttle(rows)
        if self.progress is not None:
            self.progress(rows)


def _produce_arrow(spec: str, settings: ProduceSettings, source_options: Mapping[str, Any], send) -> None:
    left = settings.limit_rows
    with open_source(spec, **source_options) as source:
        multi = source.multi_hot_tables
        while left is None or left > 0:
            want = settings.rows_per_message if left is None else min(left, settings.rows_per_message)
            batch = source.read(want)
            if batch is None:
                break
            for payload, rows in arrow_messages(batch, multi, settings.max_message_bytes):
                send(payload, rows)
            if left is not None:
                left -= len(batch)


def _settle(futures: list, settings: ProduceSettings) -> None:
    """Wait for the acknowledgements of sent messages (bounded); raise the first failure."""
    import kafka.errors as ke

    try:
        for f in futures:
            f.get(timeout=settings.flush_timeout_ms / 1000)
    except ke.MessageSizeTooLargeError as exc:
        raise ConfigError(f"the broker refused a message as too large ({exc}); lower --rows-per-message") from exc
    except ke.KafkaError as exc:
        if isinstance(exc, ke.KafkaTimeoutError):
            raise
        raise DataError(f"Kafka refused a message for topic {settings.topic!r}: {exc!r}") from exc
    futures.clear()
