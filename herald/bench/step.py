"""``herald bench step``: what ONE PS shard serves in one global step of an N-worker job.

Replayed in this process, without sockets, so that the figure is the shard's own CPU
time: synthetic Criteo-shaped rows (26 tables; ``--dim``, ``--optimizer``), ``--workers``
micro-batches of ``--batch-size`` samples per step, scheduled by the herald scheduler
(:class:`herald.scheduler.Scheduler`: allocation and one CachePlan per worker). For each
worker the requests of one step (NOTE [step protocol]: write-back, early pull, late pull,
gradient push, plan push; early pulls as the dispatcher marks them, NOTE [early pulls])
are packed by the real client code (:mod:`herald.worker.psio` over
:class:`herald.ps.PSClient`, whose socket send is replaced by a capture), and those to
shard ``--shard`` of ``--shards`` are applied by the real shard handler,
``ShardServer.handle(frames)``, timed call by call. Row values are synthetic (finite).

Baseline in the same run (``numba_limit_ns_per_row``): a bare numba lookup of the same
(table, id) keys in one hash map plus a row-wise Adagrad update of their rows, per row.

Output: a short table and, with ``--out``, JSON with ``shard_ms_per_step`` (median over
the measured steps), ``requests_per_worker_per_shard``, ``parts_per_request``,
``rows_per_step``, ``per_request_us``, ``per_row_ns`` (per op: shard time / rows of that
op), ``numba_limit_ns_per_row`` and the settings.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import zmq

from herald import keymap
from herald.bench.options import add_step_arguments
from herald.bench.scheduler import load_batches as load_source_batches
from herald.dispatch.early import early_pulls, touched_keys
from herald.errors import ConfigError
from herald.loader.splits import count_distinct_keys
from herald.ps import compress, kernels as K
from herald.ps.client import PSClient
from herald.ps.server import ShardServer, warm_up
from herald.ps.wire import PS
from herald.ps.rows import hyper_params
from herald.scheduler import Scheduler
from herald.scheduler.config import SchedulerConfig
from herald.scheduler.plan import KeySet
from herald.spec.tables import OptimizerConfig, TableConfig
from herald.worker import psio

#: the requests a worker sends each shard per step, in the order they are replayed
OPS = ("write_back", "pull_early", "pull_late", "push_grad", "plan_push")


def load_batches(source: str, global_batch: int, steps: int) -> tuple[list, list[str]]:
    """``steps`` global batches of ``global_batch`` samples from ``source``, and the table names.

    Raises:
        ConfigError: the source holds fewer than ``steps`` global batches.
    """
    batches, table_names, rows = load_source_batches(source, global_batch, max_rows=global_batch * steps)
    if len(batches) < steps:
        raise ConfigError(f"{source}: {rows} rows, {global_batch * steps} needed for {steps} steps of "
                          f"{global_batch} samples; use a larger source or fewer --steps")
    return batches[:steps], list(table_names)


class Capture:
    """A :class:`PSClient` whose requests are captured instead of sent: ``take(shard)``
    returns the frames of the requests to ``shard`` since the last call (the others dropped)."""

    def __init__(self, num_shards: int, tables: list[TableConfig], wire_dtype: str):
        self.client = PSClient([f"inproc://herald-bench-step-{i}" for i in range(num_shards)], tables,
                               declare=False, wire_dtype=wire_dtype)
        self._sent: list = []
        self.client._post = self._sent.append   # the send: keep the request (header + array frames)

    def take(self, shard: int) -> list[list]:
        out = [req.frames for req in self._sent if req.shard == shard]
        self._sent.clear()
        self.client._pending.clear()   # no reply will come
        return out

    def close(self) -> None:
        self.client.close()


def _as_received(frames: list) -> list:
    """The frames as a ROUTER hands them to the shard (zmq.Frame copies)."""
    return [zmq.Frame(bytes(memoryview(f))) for f in frames]


def _fake_rows(rng, n: int, width: int, dim: int) -> np.ndarray:
    rows = (rng.standard_normal((n, width)) * 0.01).astype(np.float32)
    rows[:, dim:] = np.abs(rows[:, dim:])   # optimizer state: non-negative
    return rows


def worker_requests(cap: Capture, plan, pull_early: np.ndarray, step: int, rank: int, rng,
                    width: int, dim: int, shard: int) -> dict[str, list]:
    """The requests worker ``rank`` sends ``shard`` in ``step`` (op -> frames), packed by
    :mod:`herald.worker.psio` as the plan executor packs them."""
    out = {}
    wb = plan.write_back
    written = KeySet(plan.evict.table[wb], plan.evict.ids[wb])
    if len(written):
        psio.push_rows_async(cap.client, written, _fake_rows(rng, len(written), width, dim))
    out["write_back"] = cap.take(shard)
    for op, mask in (("pull_early", pull_early), ("pull_late", ~pull_early)):
        if mask.any():
            psio.fetch_async(cap.client, KeySet(plan.pull.table[mask], plan.pull.ids[mask]), width)
        out[op] = cap.take(shard)
    if len(plan.grad_push):
        grads = (rng.standard_normal((len(plan.grad_push), dim)) * 0.01).astype(np.float32)
        psio.push_grads_async(cap.client, plan.grad_push, grads, plan.contributors, step, rank)
    out["push_grad"] = cap.take(shard)
    if len(plan.plan_push):
        psio.push_rows_async(cap.client, plan.plan_push, _fake_rows(rng, len(plan.plan_push), width, dim))
    out["plan_push"] = cap.take(shard)
    return out


def _request_rows(frames: list) -> tuple[int, int]:
    """(keys, parts) of one captured request."""
    header = PS.unpack_header(frames[0])
    parts = header.get("parts") or []
    arrays = header["arrays"]
    keys = sum(int(shape[0]) for dt, shape in arrays if dt == "<u8" and len(shape) == 1)
    return keys, len(parts)


def numba_limit(keys_per_step: list[KeySet], dim: int, tcfg: TableConfig, repeats: int = 3) -> float:
    """ns per row of a bare numba lookup of each step's (table, id) keys in one map holding
    every key, plus a row-wise Adagrad update of those rows: the median over steps."""
    allk = KeySet(np.concatenate([k.table for k in keys_per_step]), np.concatenate([k.ids for k in keys_per_step]))
    n = len(allk)
    slot_ids = np.zeros(n, np.uint64)
    slot_tab = np.zeros(n, np.int32)
    buckets = keymap.new_buckets(n, slot_ids, slot_tab, 0, np.int64)
    used = np.zeros(1, np.int64)
    keymap.find_or_insert_many_jit(buckets, slot_ids, slot_tab, used, allk.table, allk.ids, np.empty(n, np.int64))
    rows = np.full((int(used[0]), tcfg.row_width), 0.01, np.float32)
    hp = hyper_params(tcfg)
    kind = tcfg.optimizer.kind
    rng = np.random.default_rng(0)
    out = []
    for i, keys in enumerate(keys_per_step * (1 + repeats)):
        m = len(keys)
        slots = np.empty(m, np.int64)
        grads = (rng.standard_normal((m, dim)) * 0.01).astype(np.float32)
        order = np.arange(m, dtype=np.int64)
        t0 = time.perf_counter()
        keymap.find_many_jit(buckets, slot_ids, slot_tab, keys.table, keys.ids, slots)
        K.apply_rows_at_jit(rows, slots, grads, order, kind, dim, hp)
        dt = time.perf_counter() - t0
        if i >= len(keys_per_step) and m:   # the first pass compiles and warms
            out.append(dt * 1e9 / m)
    return float(statistics.median(out)) if out else 0.0


def run_step_bench(args: argparse.Namespace) -> dict:
    """Run the replay; returns the result dict (also printed, and written to ``args.out``)."""
    W, S, shard = args.workers, args.shards, args.shard
    if not 0 <= shard < S:
        raise SystemExit(f"--shard {shard} is not in [0, {S})")
    steps_total = args.warmup + args.steps
    G = W * args.batch_size
    source = args.source or f"synthetic://criteo?rows={G * (steps_total + 2)}&seed={args.seed}"
    batches, names = load_batches(source, G, steps_total + 1)
    opt = OptimizerConfig(name=args.optimizer, lr=0.01)
    tables = [TableConfig(name, args.dim, opt) for name in names]
    width, dim = tables[0].row_width, args.dim
    sched = Scheduler(SchedulerConfig(num_workers=W, batch_size_per_worker=args.batch_size, schedule=args.schedule,
                                      cache_ratio=args.cache_ratio, seed=args.seed),
                      len(tables), count_distinct_keys(batches))
    warm_up()
    server = ShardServer(shard, S, tables=tables, seed=args.seed)
    cap = Capture(S, tables, args.wire_dtype)
    rng = np.random.default_rng(args.seed)
    per_step = []                      # per measured step: {op: [seconds, requests, keys, parts]}
    shard_keys: list[KeySet] = []      # per measured step: every key the shard served
    touched = None
    step = 0
    try:
        for batch in batches:
            sp = sched.submit(batch)
            if sp is None:
                continue
            plans = sp.plans
            reqs = [worker_requests(cap, p, early_pulls(p.pull, touched), step, w, rng, width, dim, shard)
                    for w, p in enumerate(plans)]
            touched = touched_keys(plans)
            measured = step >= args.warmup
            acc = {op: [0.0, 0, 0, 0] for op in OPS}
            tabs, ids = [], []
            for op in OPS:
                for w in range(W):
                    for frames in reqs[w][op]:
                        keys, parts = _request_rows(frames)
                        received = _as_received(frames)
                        t0 = time.perf_counter()
                        reply = server.handle(received)
                        dt = time.perf_counter() - t0
                        head = PS.unpack_header(reply[0])
                        if not head.get("ok"):
                            raise RuntimeError(f"shard refused {op} of worker {w} at step {step}: {head}")
                        a = acc[op]
                        a[0] += dt
                        a[1] += 1
                        a[2] += keys
                        a[3] += parts
                        if measured:   # the (table, key) of every part, as the shard reads them
                            h, arrays = PS.unpack(received)
                            for p in server._parts(h, arrays, h["op"], wire_dtype=compress.wire_of(h)):
                                tabs.append(p.tables.astype(np.int32))
                                ids.append(np.array(p.keys))
            if measured:
                per_step.append(acc)
                shard_keys.append(KeySet(np.concatenate(tabs) if tabs else np.zeros(0, np.int32),
                                         np.concatenate(ids) if ids else np.zeros(0, np.uint64)))
            step += 1
            if len(per_step) == args.steps:
                break
    finally:
        cap.close()
    limit = numba_limit(shard_keys, dim, tables[0])
    return summarize(args, per_step, limit, source, len(tables))


def summarize(args, per_step: list[dict], limit_ns: float, source: str, num_tables: int) -> dict:
    """The JSON figures of :func:`run_step_bench` from its per-step accumulators."""
    W = args.workers
    ms = [1e3 * sum(a[0] for a in acc.values()) for acc in per_step]
    total = {op: [sum(acc[op][i] for acc in per_step) for i in range(4)] for op in OPS}
    requests = sum(t[1] for t in total.values())
    rows = sum(t[2] for t in total.values())
    parts = sum(t[3] for t in total.values())
    seconds = sum(t[0] for t in total.values())
    n = max(1, len(per_step))
    out = {
        "shard_ms_per_step": round(float(statistics.median(ms)), 4) if ms else 0.0,
        "requests_per_worker_per_shard": round(requests / n / W, 3),
        "parts_per_request": round(parts / max(1, requests), 3),
        "rows_per_step": round(rows / n, 1),
        "per_request_us": round(1e6 * seconds / max(1, requests), 2),
        "per_row_ns": {op: round(1e9 * t[0] / t[2], 1) for op, t in total.items() if t[2]},
        "numba_limit_ns_per_row": round(limit_ns, 1),
        "shard_ns_per_row": round(1e9 * seconds / max(1, rows), 1),
        "by_op": {op: {"requests_per_step": round(t[1] / n, 2), "rows_per_step": round(t[2] / n, 1),
                       "ms_per_step": round(1e3 * t[0] / n, 4), "us_per_request": round(1e6 * t[0] / max(1, t[1]), 2),
                       "parts_per_request": round(t[3] / max(1, t[1]), 2)}
                  for op, t in total.items()},
        "settings": {"workers": W, "shards": args.shards, "shard": args.shard, "batch_size": args.batch_size,
                     "tables": num_tables, "dim": args.dim, "optimizer": args.optimizer, "schedule": args.schedule,
                     "cache_ratio": args.cache_ratio, "wire_dtype": args.wire_dtype, "steps": len(per_step),
                     "warmup": args.warmup, "seed": args.seed, "source": source},
    }
    return out


def print_table(r: dict) -> None:
    s = r["settings"]
    print(f"herald bench step: shard {s['shard']} of {s['shards']}, {s['workers']} workers x {s['batch_size']} "
          f"samples, {s['tables']} tables, dim {s['dim']} {s['optimizer']}, {s['steps']} steps measured")
    print(f"{'op':12s} {'req/step':>9s} {'parts/req':>9s} {'rows/step':>10s} {'ms/step':>9s} {'us/req':>9s} "
          f"{'ns/row':>8s}")
    for op, b in r["by_op"].items():
        ns = r["per_row_ns"].get(op)
        print(f"{op:12s} {b['requests_per_step']:9.2f} {b['parts_per_request']:9.2f} {b['rows_per_step']:10.1f} "
              f"{b['ms_per_step']:9.3f} {b['us_per_request']:9.1f} {'-' if ns is None else f'{ns:.0f}':>8s}")
    print(f"shard ms per step (median) {r['shard_ms_per_step']:.3f}; requests per worker per shard "
          f"{r['requests_per_worker_per_shard']:.2f}; parts per request {r['parts_per_request']:.2f}; "
          f"{r['shard_ns_per_row']:.0f} ns per row vs numba limit {r['numba_limit_ns_per_row']:.0f} ns "
          f"({r['shard_ns_per_row'] / max(r['numba_limit_ns_per_row'], 1e-9):.1f}x)")


def run(args: argparse.Namespace) -> dict:
    """Entry of ``herald bench step``."""
    r = run_step_bench(args)
    print_table(r)
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=1))
        print(f"wrote {path}")
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
