"""``herald bench kafka``: samples/s turned into SampleBatches from a real Kafka broker,
``tsv`` records vs ``arrow`` records, against the Parquet path measured in the same run
on the same data.

Data: the Criteo Kaggle sample rows (``--criteo``, 7,200 train rows) replicated to
``--rows`` samples. The same samples are published raw (one Criteo line per message) to
one topic and as Arrow record batches (``--rows-per-message``) to another, and written to
a temporary Parquet file (NOTE [arrow layout]); each is then read with the loader
(``read(--batch)``) until every sample is out. A broker is started for the run
(:mod:`herald.loader.kafka.broker`) unless ``--bootstrap`` is given.

    herald bench kafka [--rows 200000] [--batch 4096] [--bootstrap HOST:PORT]

"per core" divides samples by this process's CPU seconds (the broker runs in its own
process and is not counted); the target for ``arrow`` is >= 300k samples/s per core.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaProducer

from herald.errors import ConfigError
from herald.loader.batch import SampleBatch
from herald.loader.formats.arrow import batch_to_arrow
from herald.loader.kafka.broker import API_VERSION, KafkaBroker
from herald.loader.kafka.source import KafkaSource, KafkaSourceConfig
from herald.loader.produce import arrow_messages
from herald.loader.registry import open_source

#: the consumers' client options: the test broker's protocol, fetches large enough for Arrow messages
CLIENT = {"api_version": API_VERSION, "max_partition_fetch_bytes": 16 << 20, "fetch_max_bytes": 64 << 20}


def default_criteo() -> pathlib.Path:
    """The Criteo Kaggle sample: under ``$HERALD_DATA``, else ``shared/data`` beside the checkout."""
    data = os.environ.get("HERALD_DATA", pathlib.Path(__file__).resolve().parents[3] / "shared" / "data")
    return pathlib.Path(data) / "criteo" / "criteo_kaggle_sample_train.tsv"


def _lines(path: pathlib.Path, rows: int) -> list[bytes]:
    """The first ``rows`` lines of ``path`` repeated as often as needed."""
    base = path.read_bytes().splitlines()
    return (base * (rows // len(base) + 1))[:rows]


def _publish(bootstrap: str, topic: str, payloads: list[bytes]) -> float:
    """Seconds to publish every payload to ``topic`` (one message each), flushed."""
    t0 = time.perf_counter()
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        api_version=API_VERSION,
        linger_ms=50,
        batch_size=1 << 20,
        max_request_size=2_000_000,
    )
    for p in payloads:
        producer.send(topic, p)
    producer.flush(timeout=120)
    producer.close(timeout=10)
    return time.perf_counter() - t0


def _consume(src, rows: int, batch: int) -> tuple[float, float, int]:
    """(wall s, CPU s, samples) to read ``rows`` samples in ``read(batch)`` calls."""
    n = 0
    w0, c0 = time.perf_counter(), time.process_time()
    while n < rows:
        b = src.read(batch)
        if b is None:
            break
        n += len(b)
    return time.perf_counter() - w0, time.process_time() - c0, n


def measure(
    bootstrap: str, rows: int, batch: int, rows_per_message: int, criteo: pathlib.Path
) -> list[tuple[str, float, float, int]]:
    """``(path, wall s, CPU s, samples)`` of ``kafka tsv``, ``kafka arrow`` and ``parquet``."""
    lines = _lines(criteo, rows)
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp) / "rows.tsv"
        raw.write_bytes(b"\n".join(lines) + b"\n")
        with open_source(raw) as src:
            data = SampleBatch.concat(list(src))
        payloads = [
            p for s in range(0, rows, rows_per_message) for p, _ in arrow_messages(data.slice(s, s + rows_per_message))
        ]
        run_id = uuid.uuid4().hex[:8]
        topics = {"tsv": f"bench-tsv-{run_id}", "arrow": f"bench-arrow-{run_id}"}
        print(
            f"publishing {rows:,} samples: tsv {_publish(bootstrap, topics['tsv'], lines):.1f} s, "
            f"arrow ({len(payloads)} messages) {_publish(bootstrap, topics['arrow'], payloads):.1f} s",
            flush=True,
        )
        results = []
        for fmt in ("tsv", "arrow"):
            cfg = KafkaSourceConfig(
                bootstrap,
                topics[fmt],
                f"bench-{run_id}",
                fmt,
                partitions=(0,),
                client_options=CLIENT,
                idle_timeout_ms=3000,
            )
            with KafkaSource(cfg) as src:
                _ = src.schema  # opens the consumer before timing
                results.append((f"kafka {fmt}", *_consume(src, rows, batch)))
        pq_path = pathlib.Path(tmp) / "rows.parquet"
        pq.write_table(pa.Table.from_batches([batch_to_arrow(data)]), pq_path, row_group_size=65536)
        with open_source(pq_path) as src:
            results.append(("parquet", *_consume(src, rows, batch)))
    return results


def report(results: list[tuple[str, float, float, int]], rows: int) -> None:
    """Print the table of :func:`measure`'s results and the ratios between the paths."""
    base = {name: n / wall for name, wall, _, n in results}["parquet"]
    print(f"\n{'path':<12}{'samples':>10}{'wall s':>9}{'cpu s':>8}{'samples/s':>13}{'per core':>13}{'vs parquet':>12}")
    for name, wall, cpu, n in results:
        rate = n / wall
        print(
            f"{name:<12}{n:>10,}{wall:>9.2f}{cpu:>8.2f}{rate:>13,.0f}{n / max(cpu, 1e-9):>13,.0f}{rate / base:>11.2f}x"
        )
    by = {name: n / wall for name, wall, _, n in results}
    print(
        f"\narrow / tsv = {by['kafka arrow'] / by['kafka tsv']:.1f}x, "
        f"arrow / parquet = {by['kafka arrow'] / base:.2f}x, tsv / parquet = {by['kafka tsv'] / base:.2f}x"
    )
    short = [name for name, *_, n in results if n < rows]
    if short:
        print(f"WARNING: {short} returned fewer than {rows} samples")


def check_args(args) -> pathlib.Path:
    """The Criteo file to read, once ``args`` are checked.

    Raises:
        ConfigError: ``--rows``, ``--batch`` or ``--rows-per-message`` below 1, or no such ``--criteo`` file.
    """
    if min(args.rows, args.batch, args.rows_per_message) < 1:
        raise ConfigError("bench kafka needs --rows, --batch and --rows-per-message >= 1")
    criteo = pathlib.Path(args.criteo) if args.criteo else default_criteo()
    if not criteo.is_file():
        raise ConfigError(f"no Criteo sample at {criteo}: pass --criteo FILE (or set HERALD_DATA)")
    return criteo


def run(args) -> None:
    """``herald bench kafka``: start a broker unless ``--bootstrap`` names one, measure, print.

    Raises:
        ConfigError: see :func:`check_args`. BrokerError: the broker could not start.
    """
    criteo = check_args(args)
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker = KafkaBroker()
        bootstrap = broker.start()
        print(f"started Kafka 0.9.0.1 at {bootstrap} in {broker.start_seconds:.1f} s", flush=True)
    try:
        report(measure(bootstrap, args.rows, args.batch, args.rows_per_message, criteo), args.rows)
    finally:
        if broker is not None:
            broker.stop()
