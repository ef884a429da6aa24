"""Kafka source benchmark: samples/s turned into SampleBatches from a real broker,
``tsv`` records vs ``arrow`` records, against the Parquet path measured in the same run
on the same data.

Data: the Criteo Kaggle sample rows (``../shared/data/criteo``, 7,200 train rows)
replicated to ``--rows`` samples. The same samples are published raw (one Criteo line
per message) to one topic and as Arrow record batches (``--rows-per-message``) to
another, and written to a temporary Parquet file (NOTE [arrow layout]); each is then
read with the loader (``read(--batch)``) until every sample is out. A broker is
started for the run (``tests/integration/kafka_broker.py``) unless ``--bootstrap`` is given.

    python bench/bench_kafka.py [--rows 200000] [--batch 4096] [--bootstrap HOST:PORT]

"per core" divides samples by this process's CPU seconds (the broker runs in its own
process and is not counted); the target for ``arrow`` is >= 300k samples/s per core.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
import uuid

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
DATA = pathlib.Path(os.environ.get("HERALD_DATA", REPO.parent / "shared" / "data"))
CLIENT = {"api_version": (0, 9), "max_partition_fetch_bytes": 16 << 20, "fetch_max_bytes": 64 << 20}


def _lines(rows: int) -> list[bytes]:
    base = (DATA / "criteo" / "criteo_kaggle_sample_train.tsv").read_bytes().splitlines()
    return (base * (rows // len(base) + 1))[:rows]


def _publish(bootstrap: str, topic: str, payloads: list[bytes]) -> float:
    from kafka import KafkaProducer

    t0 = time.perf_counter()
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, api_version=(0, 9), linger_ms=50, batch_size=1 << 20, max_request_size=2_000_000
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


def run(bootstrap: str, rows: int, batch: int, rows_per_message: int) -> list[tuple[str, float, float, int]]:
    from herald.loader.batch import SampleBatch
    from herald.loader.kafka.source import KafkaSource, KafkaSourceConfig
    from herald.loader.produce import arrow_messages
    from herald.loader.registry import open_source

    lines = _lines(rows)
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

        import pyarrow.parquet as pq

        from herald.loader.formats.arrow import batch_to_arrow

        pq_path = pathlib.Path(tmp) / "rows.parquet"
        pq.write_table(pa_table(data, batch_to_arrow), pq_path, row_group_size=65536)
        with open_source(pq_path) as src:
            results.append(("parquet", *_consume(src, rows, batch)))
    return results


def pa_table(data, batch_to_arrow):
    import pyarrow as pa

    return pa.Table.from_batches([batch_to_arrow(data)])


def report(results, rows: int) -> None:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=4096, help="max_rows per read()")
    p.add_argument("--rows-per-message", type=int, default=2048, help="samples per Arrow message")
    p.add_argument("--bootstrap", default=None, help="use this broker (api_version 0.9) instead of starting one")
    args = p.parse_args(argv)
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        sys.path.insert(0, str(REPO / "tests" / "integration"))
        from kafka_broker import KafkaBroker

        broker = KafkaBroker()
        bootstrap = broker.start()
        print(f"started Kafka 0.9.0.1 at {bootstrap} in {broker.start_seconds:.1f} s", flush=True)
    try:
        report(run(bootstrap, args.rows, args.batch, args.rows_per_message), args.rows)
    finally:
        if broker is not None:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
