"""Fake workers that answer the dispatcher at once: the peers of a capacity measurement.

One thread (normally in a child process, ``python -m herald.bench.ackpeers``, so it
shares the cores but not the GIL with the dispatcher, as real workers do) holds one
DEALER socket per rank and plays NOTE [dispatch protocol] as cheaply as it can: it says
hello, then for every message parses
only the header frame (msgpack; the array frames are received and dropped, never
decoded) and answers ``ack {step}`` to a micro-batch, ``flushed`` to a flush and
``saved`` to a save. It ends when every rank got ``end`` or ``error``, or when the
dispatcher sent nothing for ``idle_timeout_s`` (a bounded wait: it never outlives a dead
dispatcher).
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgpack
import zmq

from herald.wire import DISPATCH

_ANSWERS = {"flush": "flushed", "save": "saved"}


def _pack(header: dict) -> bytes:
    return msgpack.packb({**header, "v": DISPATCH.version, "arrays": []}, use_bin_type=True)


def run_ack_peers(address: str, num_workers: int, idle_timeout_s: float = 30.0) -> dict:
    """Serve ranks ``0..num_workers-1`` against the dispatcher at ``address`` until the end.

    Args:
        address: the dispatcher's bound endpoint.
        num_workers: ranks played (the dispatcher's ``num_workers``).
        idle_timeout_s: longest silence of the dispatcher before giving up.

    Returns:
        ``{"acks": micro-batches acked, "ended": ranks that got end, "error": the
        dispatcher's error message or None, "timed_out": bool}``.
    """
    ctx = zmq.Context()
    socks = []
    try:
        poller = zmq.Poller()
        for rank in range(num_workers):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, f"worker-{rank}".encode())
            s.connect(address)
            s.send(_pack({"op": "hello", "rank": rank, "world_size": num_workers}))
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        rank_of = {s: r for r, s in enumerate(socks)}
        acks, ended, error = 0, set(), None
        last = time.monotonic()
        while len(ended) < num_workers:
            ready = poller.poll(100)
            if not ready:
                if time.monotonic() - last > idle_timeout_s:
                    return {"acks": acks, "ended": len(ended), "error": error, "timed_out": True}
                continue
            last = time.monotonic()
            for s, _ in ready:  # one message per ready socket and poll: no failing reads
                rank = rank_of[s]
                frames = s.recv_multipart(copy=False)
                header = msgpack.unpackb(frames[0].buffer, raw=False)
                op = header.get("op")
                if op == "microbatch":
                    s.send(_pack({"op": "ack", "rank": rank, "step": header["step"], "loss": 0.0}))
                    acks += 1
                elif op in _ANSWERS:
                    s.send(_pack({"op": _ANSWERS[op], "rank": rank}))
                elif op in ("end", "error"):
                    ended.add(rank)
                    if op == "error":
                        error = header.get("message")
        return {"acks": acks, "ended": len(ended), "error": error, "timed_out": False}
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    """``python -m herald.bench.ackpeers ADDRESS NUM_WORKERS [IDLE_TIMEOUT_S [NICE]]``:
    run the peers (at ``nice`` increment NICE, default 0), print their summary as one
    JSON line; exit status 1 if they timed out."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3, 4):
        print("usage: python -m herald.bench.ackpeers ADDRESS NUM_WORKERS [IDLE_TIMEOUT_S [NICE]]", file=sys.stderr)
        return 2
    if len(args) == 4 and int(args[3]):
        os.nice(int(args[3]))
    summary = run_ack_peers(args[0], int(args[1]), float(args[2]) if len(args) >= 3 else 30.0)
    print(json.dumps(summary), flush=True)
    return 1 if summary["timed_out"] else 0


if __name__ == "__main__":
    sys.exit(main())
