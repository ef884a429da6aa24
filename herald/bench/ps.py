"""``herald bench ps``: pull / push throughput of one shard next to a numpy memcpy.

Two baselines, measured in the same run: a numpy copy of the same bytes (the
physical limit of moving that payload on this machine) and a bare ZeroMQ
request/reply carrying the same bytes over TCP loopback (the transport's limit,
with no PS work at all). Payload = embedding bytes
(``keys x dim x 4``; the bench table uses SGD, so rows carry no optimizer state).
Each client thread has its own :class:`PSClient` and keeps one request in flight.
Run over TCP loopback (the deployment transport) and IPC (same-host shards).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import threading
import time

import numpy as np
import zmq

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.ps.client import PSClient
from herald.ps.local import LocalShards


def memcpy_gbps(nbytes: int, seconds: float) -> float:
    """Median GB/s of ``np.copyto`` between two ``nbytes`` buffers (single thread)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    rates = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 5:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def zmq_gbps(nbytes: int, seconds: float, transport: str = "tcp", workdir=None) -> float:
    """Median GB/s of a bare ZeroMQ DEALER->ROUTER request answered by an ``nbytes``
    zero-copy reply over TCP loopback or IPC (a thread in this process): the
    transport's limit."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if transport == "tcp":
        address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        address = f"ipc://{workdir}/bare-zmq.ipc"
        router.bind(address)
    payload = np.ones(nbytes // 4, np.float32)

    def echo():
        while True:
            if not router.poll(10_000):
                return
            ident, msg = router.recv_multipart()
            router.send_multipart([ident, payload if msg == b"x" else b""], copy=False)
            if msg != b"x":
                return

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    rates = []
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end or len(rates) < 5:
            t0 = time.perf_counter()
            dealer.send(b"x")
            if not dealer.poll(10_000):
                raise TimeoutError("zmq baseline echo thread did not answer")
            dealer.recv(copy=False)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        dealer.send(b"q")
        th.join(timeout=10)
    finally:
        dealer.close()
        router.close()
    return statistics.median(rates)


def _worker(addresses, table, op, n_keys, table_rows, seconds, seed, out, errors):
    try:
        rng = np.random.default_rng(seed)
        dim = table.dim
        grads = np.full((n_keys, dim), 1e-3, np.float32)
        rows = np.zeros((n_keys, table.row_width), np.float32)
        ones = np.ones(n_keys, np.uint16)
        lat = []
        with PSClient(addresses, [table], timeout_ms=30_000, retries=0) as client:
            step = 0
            pool = [np.unique(rng.integers(0, table_rows, n_keys, dtype=np.uint64)) for _ in range(16)]
            t_start = time.perf_counter()
            end = t_start + seconds
            while time.perf_counter() < end:
                keys = pool[step % len(pool)]
                t0 = time.perf_counter()
                if op == "pull":
                    client.pull(0, keys)
                elif op == "push_grad":
                    client.push_grad(0, keys, grads[: keys.size], step=step, contributors=ones[: keys.size])
                else:
                    client.push_rows(0, keys, rows[: keys.size])
                lat.append((time.perf_counter() - t0, keys.size))
                step += 1
        out.append((lat, t_start, time.perf_counter()))
    except Exception as exc:  # passed to the main thread, never lost
        errors.append(exc)


def _round(addresses, table, op, n_keys, table_rows, seconds, n_threads, seed) -> tuple[float, list[float]]:
    """One timed round with ``n_threads`` clients: (GB/s of payload, request latencies in s)."""
    out, errors = [], []
    ths = [
        threading.Thread(
            target=_worker, args=(addresses, table, op, n_keys, table_rows, seconds, seed + k, out, errors)
        )
        for k in range(n_threads)
    ]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=seconds + 120)
    if errors:
        raise errors[0]
    if len(out) != n_threads:
        raise TimeoutError(f"{n_threads - len(out)} benchmark client threads did not finish")
    wall = max(e for _, _, e in out) - min(s for _, s, _ in out)
    lat = [x for lst, _, _ in out for x in lst]
    return sum(k for _, k in lat) * table.dim * 4 / wall / 1e9, [s for s, _ in lat]


def run(
    dim: int = 128,
    keys=(1000, 10000),
    threads=(1, 2, 4),
    seconds: float = 0.3,
    repeats: int = 3,
    table_rows: int = 200_000,
    ops=("pull", "push_grad", "push_rows"),
    transports=("tcp", "ipc"),
) -> list[dict]:
    """Run every (transport, op, keys, threads) configuration ``repeats`` times for
    ``seconds`` each; returns one result dict each (median GB/s over the rounds, latency
    percentiles over all requests)."""
    results = []
    for transport in transports:
        results.extend(_run_transport(transport, dim, keys, threads, seconds, repeats, table_rows, ops))
    return results


def _run_transport(transport, dim, keys, threads, seconds, repeats, table_rows, ops) -> list[dict]:
    table = TableConfig("bench", dim, OptimizerConfig("sgd", lr=0.01), init="uniform")
    results = []
    with LocalShards(num_shards=1, tables=[table], seed=0, transport=transport) as shards:
        with PSClient(shards.addresses, [table], timeout_ms=60_000) as client:
            for start in range(0, table_rows, 50_000):  # materialise the table
                client.pull(0, np.arange(start, min(start + 50_000, table_rows), dtype=np.uint64))
        for n_keys in keys:
            payload = n_keys * dim * 4
            base = memcpy_gbps(payload, min(seconds, 0.5))
            wire_base = zmq_gbps(payload, min(seconds, 0.5), transport, shards.workdir)
            for op in ops:
                for n_threads in threads:
                    rates, lat = [], []
                    for rep in range(repeats):
                        gbps, lat_rep = _round(
                            shards.addresses,
                            table,
                            op,
                            n_keys,
                            table_rows,
                            seconds,
                            n_threads,
                            1000 * rep + 100 * n_threads,
                        )
                        rates.append(gbps)
                        lat.extend(lat_rep)
                    gbps = statistics.median(rates)
                    secs = np.array(lat)
                    results.append(
                        {
                            "transport": transport,
                            "op": op,
                            "keys": n_keys,
                            "threads": n_threads,
                            "requests": len(lat),
                            "gbps": gbps,
                            "memcpy_gbps": base,
                            "ratio": gbps / base,
                            "zmq_gbps": wire_base,
                            "zmq_ratio": gbps / wire_base,
                            "p50_ms": float(np.percentile(secs, 50) * 1e3),
                            "p99_ms": float(np.percentile(secs, 99) * 1e3),
                        }
                    )
    return results


def format_table(results: list[dict]) -> str:
    lines = [
        "| transport | op | keys/req | threads | GB/s | memcpy GB/s | vs memcpy | bare zmq GB/s | vs zmq "
        "| p50 ms | p99 ms | requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['transport']} | {r['op']} | {r['keys']} | {r['threads']} | {r['gbps']:.2f} | "
            f"{r['memcpy_gbps']:.2f} | "
            f"{100 * r['ratio']:.0f}% | {r['zmq_gbps']:.2f} | {100 * r['zmq_ratio']:.0f}% | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['requests']} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace | None = None) -> int:
    """Entry of ``herald bench ps``: prints a markdown table, writes the rows as JSON to ``--out``."""
    kw = (
        {}
        if args is None
        else {
            "dim": args.dim,
            "keys": tuple(args.keys),
            "threads": tuple(args.threads),
            "seconds": args.seconds,
            "repeats": args.repeats,
            "table_rows": args.table_rows,
            "transports": tuple(args.transport),
        }
    )
    results = run(**kw)
    print(format_table(results))
    out = pathlib.Path(getattr(args, "out", None) or "runs/bench-ps.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0
