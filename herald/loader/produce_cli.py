"""``herald produce``: publish a dataset into a Kafka topic (see :mod:`herald.loader.produce`).

Registered by :mod:`herald.loader.cli`.
"""

from __future__ import annotations

import sys

from herald.config import add_key_value_option, parse_value
from herald.errors import ConfigError
from herald.inputs import check_input_path, float_type, host_port, int_type


def _brokers(text: str) -> str:
    """argparse type of ``--bootstrap HOST:PORT[,HOST:PORT...]`` (NOTE [front doors] in herald/inputs.py)."""
    import argparse

    try:
        for broker in text.split(","):
            host_port(broker, "a broker")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def register(commands) -> None:
    """Add ``herald produce`` to the top-level commands."""
    p = commands.add_parser(
        "produce",
        help="publish a dataset into a Kafka topic (arrow batches or raw tsv/csv lines)",
        description="Publish SOURCE (any path or URL the loader opens) into a Kafka topic that "
        "herald's Kafka source (kafka://HOST:PORT/TOPIC?format=...&group=...) reads. "
        "--format arrow: one Arrow IPC record batch of --rows-per-message samples per message, "
        "from any source. --format tsv/csv: raw Criteo/Avazu lines, one per message, "
        "from a Criteo .tsv / Avazu .csv file only.",
    )
    p.add_argument(
        "source", metavar="SOURCE", help="dataset path or URL (e.g. data.tsv, dir/, synthetic://criteo?rows=1000)"
    )
    p.add_argument("--bootstrap", required=True, type=_brokers, metavar="HOST:PORT", help="broker(s), comma-separated")
    p.add_argument("--topic", required=True, type=_topic)
    p.add_argument("--format", choices=("arrow", "tsv", "csv"), default="arrow")
    p.add_argument("--rows-per-message", type=int_type(1), default=1024, metavar="N", help="samples per Arrow message")
    p.add_argument(
        "--rate",
        type=float_type("> 0", lambda x: x > 0),
        default=None,
        metavar="SAMPLES_PER_S",
        help="throttle (default: unthrottled)",
    )
    p.add_argument("--limit", type=int_type(1), default=None, metavar="N", help="publish at most N samples")
    add_key_value_option(
        p, "--client-option", "kafka-python KafkaProducer setting, repeatable (e.g. api_version=0.9, acks=all)"
    )
    add_key_value_option(p, "--source-option", "loader option for SOURCE (arrow only; e.g. bad_records=skip)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_produce)


def _topic(text: str) -> str:
    """argparse type of ``--topic``: Kafka's legal topic names (1..249 of ``[A-Za-z0-9._-]``)."""
    import argparse
    import re

    if re.fullmatch(r"[A-Za-z0-9._-]{1,249}", text) is None or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"must be 1..249 characters of A-Z a-z 0-9 . _ -, got {text!r:.60}")
    return text


def run_produce(args) -> int:
    """Entry of ``herald produce``; prints a one-line summary."""
    if "://" not in args.source:  # NOTE [front doors]: a FIFO or a missing file, before kafka-python loads
        check_input_path(args.source, "SOURCE")
    # imported on use: building the herald parser must not load numba and pyarrow (~0.5 s)
    from herald.loader.kafka.config import parse_kafka_value
    from herald.loader.produce import ProduceSettings, check_text_source, produce

    options = {k: parse_kafka_value(k, v) for k, v in args.client_option}
    named = {"bootstrap_servers": "bootstrap", "rate_samples_per_s": "rate", "limit_rows": "limit"}  # field: option
    given = {field: getattr(args, option) for field, option in named.items()}
    settings = ProduceSettings(
        topic=args.topic, format=args.format, rows_per_message=args.rows_per_message, client_options=options, **given
    )
    source_options = {k: parse_value(v) for k, v in args.source_option}
    if settings.format != "arrow":
        check_text_source(args.source, settings.format)  # before the progress bar appears
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.limit, unit="sample", unit_scale=True, desc=f"produce {args.topic}", file=sys.stderr)
    try:
        stats = produce(
            args.source, settings, source_options=source_options, progress=bar.update if bar is not None else None
        )
    finally:
        if bar is not None:
            bar.close()
    rate = stats["rows"] / stats["seconds"] if stats["seconds"] > 0 else float("inf")
    print(
        f"published {stats['rows']} samples in {stats['messages']} messages ({stats['bytes'] / 1e6:.1f} MB) "
        f"to {args.topic} in {stats['seconds']:.2f} s ({rate:,.0f} samples/s)"
    )
    return 0
