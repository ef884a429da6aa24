"""``herald bench step``: what ONE PS shard serves in one global step of an N-worker job.

Replayed in this process, without sockets, so that the figure is the shard's own CPU
time: synthetic Criteo-shaped rows (26 tables; ``--dim``, ``--optimizer``), ``--workers``
micro-batches of ``--batch-size`` samples per step, scheduled by the herald scheduler
(:class:`herald.scheduler.Scheduler`: allocation and one CachePlan per worker). Each
worker sends each shard one step message per step (NOTE [step messages] in
herald/ps/stepped.py): its plan pushes of step t with the write-backs of its evictions
at t + 1, its gradients of t, and its pulls of t + 1, packed by the real client code
(:meth:`herald.ps.PSClient.step_async`, whose socket send is replaced by a capture).
The messages to shard ``--shard`` of ``--shards`` are captured once, then replayed
``--repeats`` times, each time by a fresh shard, back to back as a shard process of its own
serves them (the scheduler's work is not between two steps): the real shard handler,
``ShardServer.receive(peer, frames)``, timed call by call (the last rank's message
releases every rank's pulls and the sum of the dense gradients: ``--dense-params``,
herald's DLRM by default). The time of each op inside (``push_rows``, ``push_grad``,
``pull``: its slots found on arrival, its rows read at the release) is taken by timing the
shard's methods; the whole messages' time by a second replay without those timers. Row
values are synthetic (finite).

Baseline in the same run (``numba_limit_ns_per_row``): a bare numba lookup of the same
(table, id) keys in one hash map plus a row-wise Adagrad update of their rows, per row,
timed after each repeat; ``ratio_vs_numba_limit`` is the median of the repeats' ratios
to their own limit (this machine's speed drifts by a third from one run to the next).

Output: a short table and, with ``--out``, JSON with ``shard_ms_per_step`` (median over
the measured steps), ``requests_per_worker_per_shard``, ``parts_per_request`` (flat parts
per op section of a request, as the shard's op methods see them), ``sections_per_request``,
``rows_per_step``, ``per_request_us``, ``per_row_ns`` (per
op: its time / its rows), ``numba_limit_ns_per_row``, ``ratio_vs_numba_limit``, the
settings, and ``repeats`` (each repeat's figures); every figure is the median over the
repeats. ``arrivals``: the replaying shard's arrivals of every step of the last repeat
(NOTE [step arrivals] in herald/ps/arrivals.py: per step the rank that came last and its
lag; replayed back to back, a lag is the shard's own time on the ranks' messages before
it, not a worker's skew, which ``herald bench device`` reads from real jobs).
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
from herald.contracts.plan import KeySet
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ConfigError
from herald.loader.splits import count_distinct_keys
from herald.ps import kernels as K
from herald.ps.client import PSClient
from herald.ps.rows import hyper_params
from herald.ps.server import ShardServer, warm_up
from herald.ps.wire import PS
from herald.scheduler import Scheduler
from herald.scheduler.config import SchedulerConfig

#: the ops inside a step message, in the order the shard applies them
OPS = ("push_rows", "push_grad", "pull")


def load_batches(source: str, global_batch: int, steps: int) -> tuple[list, list[str]]:
    """``steps`` global batches of ``global_batch`` samples from ``source``, and the table names.

    Raises:
        ConfigError: the source holds fewer than ``steps`` global batches.
    """
    batches, table_names, rows = load_source_batches(source, global_batch, max_rows=global_batch * steps)
    if len(batches) < steps:
        raise ConfigError(
            f"{source}: {rows} rows, {global_batch * steps} needed for {steps} steps of "
            f"{global_batch} samples; use a larger source or fewer --steps"
        )
    return batches[:steps], list(table_names)


class Capture:
    """A :class:`PSClient` whose requests are captured instead of sent: ``take(shard)``
    returns the frames of the requests to ``shard`` since the last call (the others dropped)."""

    def __init__(self, num_shards: int, tables: list[TableConfig], wire_dtype: str):
        self.client = PSClient(
            [f"inproc://herald-bench-step-{i}" for i in range(num_shards)], tables, declare=False, wire_dtype=wire_dtype
        )
        self._sent: list = []
        self.client.link.post = self._sent.append  # the send: keep the request (header + array frames)

    def take(self, shard: int) -> list[list]:
        out = [req.frames for req in self._sent if req.shard == shard]
        self._sent.clear()
        self.client.link.drop_pending()  # no reply will come
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the client (:meth:`herald.ps.client.PSClient.close`)."""
        self.client.close(timeout_s)


def _as_received(frames: list[bytes]) -> list:
    """The frames as a ROUTER hands them to the shard (zmq.Frame copies)."""
    return [zmq.Frame(f) for f in frames]


def _fake_rows(rng, n: int, width: int, dim: int) -> np.ndarray:
    rows = (rng.standard_normal((n, width)) * 0.01).astype(np.float32)
    rows[:, dim:] = np.abs(rows[:, dim:])  # optimizer state: non-negative
    return rows


def step_message(
    cap: Capture,
    plan,
    next_plan,
    step: int,
    rank: int,
    workers: int,
    rng,
    width: int,
    dim: int,
    shard: int,
    dense_params: int = 0,
) -> list[list]:
    """The requests worker ``rank`` sends ``shard`` at the end of ``step`` (its step message,
    NOTE [step messages]): the plan pushes of ``plan`` and the write-backs of ``next_plan``'s
    evictions, the gradients of ``plan``, the pulls of ``next_plan``, and ``dense_params``
    dense gradient values (NOTE [dense gradients on the shards])."""
    wb = next_plan.write_back
    written = KeySet(
        np.concatenate([plan.plan_push.table, next_plan.evict.table[wb]]),
        np.concatenate([plan.plan_push.ids, next_plan.evict.ids[wb]]),
    )
    grads = (rng.standard_normal((len(plan.grad_push), dim)) * 0.01).astype(np.float32)
    cap.client.step_async(
        step,
        rank,
        workers,
        rows=(written.table, written.ids, _fake_rows(rng, len(written), width, dim)),
        grads=(plan.grad_push.table, plan.grad_push.ids, grads, plan.contributors),
        pull=(next_plan.pull.table, next_plan.pull.ids),
        dense=(rng.standard_normal(dense_params) * 0.01).astype(np.float32) if dense_params else None,
    )
    return cap.take(shard)


def dlrm_dense_params(num_tables: int, dense_dim: int, dim: int) -> int:
    """Parameters of herald's DLRM (:func:`herald.worker.models.build_model`) of this shape."""
    from herald.worker.models import build_model  # on use: torch

    return sum(p.numel() for p in build_model("dlrm", dense_dim, num_tables, dim, seed=0).parameters())


class OpTimes:
    """Seconds, calls, keys and parts of each op the shard runs inside step messages: the
    methods of its row ops the step messages call (``push_rows``, ``push_grad``; a pull's
    ``resolve_pull`` on arrival and ``read_pull`` at the release) wrapped on the instance
    (:class:`herald.ps.ops_rows.RowOps`, ``ShardServer.rows``)."""

    def __init__(self, server: ShardServer):
        self.acc = {op: [0.0, 0, 0, 0] for op in OPS}
        rows = server.rows
        for op, method in (
            ("push_rows", "push_rows"),
            ("push_grad", "push_grad"),
            ("pull", "resolve_pull"),
            ("pull", "read_pull"),
        ):
            setattr(rows, method, self._timed(op, getattr(rows, method), counted=method != "read_pull"))

    def _timed(self, op: str, method, counted: bool = True):
        """``method`` timed into ``op``; ``counted``: its ``(header, arrays)`` call also counts
        a call, its keys and parts (a pull's ``read_pull`` adds only its time)."""
        acc = self.acc[op]

        def run(*args):
            t0 = time.perf_counter()
            out = method(*args)
            acc[0] += time.perf_counter() - t0
            if counted:
                header, arrays = args
                acc[1] += 1
                acc[2] += int(arrays[1].shape[0])  # flat part: tables, keys, ...
                acc[3] += len(header["parts"])
            return out

        return run

    def take(self) -> dict[str, list]:
        out = {op: list(a) for op, a in self.acc.items()}
        for a in self.acc.values():
            a[:] = [0.0, 0, 0, 0]
        return out


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
        if i >= len(keys_per_step) and m:  # the first pass compiles and warms
            out.append(dt * 1e9 / m)
    return float(statistics.median(out)) if out else 0.0


def capture_steps(args: argparse.Namespace, tables: list[TableConfig], dense: int, batches: list) -> tuple[list, list]:
    """Every measured and warm-up step's messages to shard ``args.shard``, packed once by the
    real client: per step ``[(worker, frames, op sections), ...]``, and per measured step
    the (table, key) of every key in them, as the shard reads them."""
    W, S, shard = args.workers, args.shards, args.shard
    width, dim = tables[0].row_width, args.dim
    sched = Scheduler(
        SchedulerConfig(
            num_workers=W,
            batch_size_per_worker=args.batch_size,
            schedule=args.schedule,
            cache_ratio=args.cache_ratio,
            seed=args.seed,
        ),
        len(tables),
        count_distinct_keys(batches),
    )
    cap = Capture(S, tables, args.wire_dtype)
    rng = np.random.default_rng(args.seed)
    steps, shard_keys, before = [], [], None
    try:
        for batch in batches:
            sp = sched.submit(batch)
            if sp is None:
                continue
            if before is None:
                before = sp.plans
                continue
            step = len(steps)
            msgs = [
                _captured(w, frames)
                for w, (p, q) in enumerate(zip(before, sp.plans))
                for frames in step_message(cap, p, q, step, w, W, rng, width, dim, shard, dense)
            ]
            before = sp.plans
            steps.append(msgs)
            if step >= args.warmup:
                shard_keys.append(_keys_of(msgs))
            if len(steps) == args.warmup + args.steps:
                break
    finally:
        cap.close()
    return steps, shard_keys


def _captured(worker: int, frames: list) -> tuple[int, list[bytes], int]:
    """One captured message: its frames copied (the client may reuse the arrays it packed)
    and its op sections, counted once here rather than at every replay."""
    return worker, [bytes(memoryview(f)) for f in frames], len(PS.unpack_header(frames[0]).get("sections", [])) or 1


def _keys_of(msgs: list) -> KeySet:
    """The (table, key) of every section of these step messages but the dense one."""
    tabs, ids = [], []
    for _, frames, _ in msgs:
        head, arrays = PS.unpack(frames)
        at = 0
        for sec in head.get("sections", []):
            if sec["op"] != "dense":
                tabs.append(arrays[at].astype(np.int32))
                ids.append(np.array(arrays[at + 1]))
            at += sec["frames"]
    return KeySet(
        np.concatenate(tabs) if tabs else np.zeros(0, np.int32), np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    )


def replay(
    args: argparse.Namespace, tables: list[TableConfig], steps: list, by_op: bool = True
) -> tuple[list[dict], dict]:
    """The captured ``steps`` served by a fresh shard, timed; per measured step
    ``{"total": [s, requests, sections], op: [s, calls, keys, parts]}`` (``by_op`` False:
    the ops untimed, only ``total``), and the shard's arrivals of every step (NOTE [step
    arrivals] in herald/ps/arrivals.py: replayed back to back, a rank's lag is the
    shard's time on the ranks' messages before it).

    Raises:
        RuntimeError: the shard refused a step message (a bug of the replay or of the shard).
    """
    server = ShardServer(args.shard, args.shards, tables=tables, seed=args.seed)
    ops = OpTimes(server) if by_op else None
    per_step = []
    for step, msgs in enumerate(steps):
        total = [0.0, 0, 0]
        if ops is not None:
            ops.take()
        for w, frames, sections in msgs:
            received = _as_received(frames)
            t0 = time.perf_counter()
            replies = server.receive(w, received)
            total[0] += time.perf_counter() - t0
            total[1] += 1
            total[2] += sections
            for _, frames_out in replies:
                reply = PS.unpack_header(frames_out[0])
                if not reply.get("ok"):
                    raise RuntimeError(f"shard refused the step message of worker {w} at step {step}: {reply}")
        if step >= args.warmup:
            per_step.append({"total": total, **(ops.take() if ops is not None else {})})
    return per_step, server.steps.stats()["arrivals"]


def run_step_bench(args: argparse.Namespace) -> dict:
    """Run the replay ``args.repeats`` times; returns the result dict (also printed, and
    written to ``args.out``): each figure the median over the repeats, ``repeats`` the
    figures of each (a repeat's ratio is to its own limit, timed right after it)."""
    W, S, shard = args.workers, args.shards, args.shard
    if not 0 <= shard < S:
        raise SystemExit(f"--shard {shard} is not in [0, {S})")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    steps_total = args.warmup + args.steps
    G = W * args.batch_size
    source = args.source or f"synthetic://criteo?rows={G * (steps_total + 3)}&seed={args.seed}"
    batches, names = load_batches(source, G, steps_total + 2)  # the scheduler and the pulls of t + 1 look ahead
    opt = OptimizerConfig(name=args.optimizer, lr=0.01)
    tables = [TableConfig(name, args.dim, opt) for name in names]
    dense = (
        dlrm_dense_params(len(tables), batches[0].dense.shape[1], args.dim)
        if args.dense_params is None
        else args.dense_params
    )
    steps, shard_keys = capture_steps(args, tables, dense, batches)
    warm_up()
    runs, arrivals = [], {}
    for _ in range(args.repeats):  # a noisy machine: each repeat's ratio against its own limit
        per_step, _ = replay(args, tables, steps)
        # the whole messages timed again without the op timers (4 wrapped calls per message,
        # ~1.5 us each, that a shard process does not run), right before the limit
        bare_steps, arrivals = replay(args, tables, steps, by_op=False)
        for timed, bare in zip(per_step, bare_steps):
            timed["total"] = bare["total"]
        runs.append(summarize(args, per_step, numba_limit(shard_keys, args.dim, tables[0]), source, len(tables), dense))
    out = _median_of(runs)  # ratio_vs_numba_limit among them: the median of the repeats' ratios
    out["repeats"] = [
        {k: r[k] for k in ("shard_ms_per_step", "shard_ns_per_row", "numba_limit_ns_per_row", "ratio_vs_numba_limit")}
        for r in runs
    ]
    out["arrivals"] = arrivals  # the last bare replay's (NOTE [step arrivals]), warm-up steps in
    return out


def _median_of(runs: list[dict]) -> dict:
    """Per numeric field (nested maps too), the median over ``runs``; ``settings`` from the first."""

    def med(values: list):
        first = values[0]
        if isinstance(first, dict):
            return {k: med([v[k] for v in values]) for k in first}
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return round(float(statistics.median(values)), 4)
        return first

    return {k: (runs[0][k] if k == "settings" else med([r[k] for r in runs])) for k in runs[0]}


def summarize(args, per_step: list[dict], limit_ns: float, source: str, num_tables: int, dense_params: int) -> dict:
    """The JSON figures of :func:`run_step_bench` from its per-step accumulators."""
    W = args.workers
    ms = [1e3 * acc["total"][0] for acc in per_step]
    seconds, requests, sections = (sum(acc["total"][i] for acc in per_step) for i in range(3))
    total = {op: [sum(acc[op][i] for acc in per_step) for i in range(4)] for op in OPS}
    rows = sum(t[2] for t in total.values())
    n = max(1, len(per_step))
    return {
        "shard_ms_per_step": round(float(statistics.median(ms)), 4) if ms else 0.0,
        "requests_per_worker_per_shard": round(requests / n / W, 3),
        "parts_per_request": round(sum(t[3] for t in total.values()) / max(1, sum(t[1] for t in total.values())), 3),
        "sections_per_request": round(sections / max(1, requests), 3),
        "rows_per_step": round(rows / n, 1),
        "per_request_us": round(1e6 * seconds / max(1, requests), 2),
        "per_row_ns": {op: round(1e9 * t[0] / t[2], 1) for op, t in total.items() if t[2]},
        "numba_limit_ns_per_row": round(limit_ns, 1),
        "shard_ns_per_row": round(1e9 * seconds / max(1, rows), 1),
        "ratio_vs_numba_limit": round(1e9 * seconds / max(1, rows) / max(limit_ns, 1e-9), 2),
        "by_op": {
            op: {
                "calls_per_step": round(t[1] / n, 2),
                "rows_per_step": round(t[2] / n, 1),
                "ms_per_step": round(1e3 * t[0] / n, 4),
            }
            for op, t in total.items()
        },
        "settings": {
            "workers": W,
            "shards": args.shards,
            "shard": args.shard,
            "batch_size": args.batch_size,
            "tables": num_tables,
            "dim": args.dim,
            "optimizer": args.optimizer,
            "schedule": args.schedule,
            "cache_ratio": args.cache_ratio,
            "wire_dtype": args.wire_dtype,
            "steps": len(per_step),
            "warmup": args.warmup,
            "repeats": args.repeats,
            "seed": args.seed,
            "source": source,
            "dense_params": dense_params,
        },
    }


def print_table(r: dict) -> None:
    s = r["settings"]
    print(
        f"herald bench step: shard {s['shard']} of {s['shards']}, {s['workers']} workers x {s['batch_size']} "
        f"samples, {s['tables']} tables, dim {s['dim']} {s['optimizer']}, {s['steps']} steps measured, "
        f"{s['repeats']} repeat(s)"
    )
    print(f"{'op':10s} {'calls/step':>10s} {'rows/step':>10s} {'ms/step':>9s} {'ns/row':>8s}")
    for op, b in r["by_op"].items():
        ns = r["per_row_ns"].get(op)
        print(
            f"{op:10s} {b['calls_per_step']:10.2f} {b['rows_per_step']:10.1f} {b['ms_per_step']:9.3f} "
            f"{'-' if ns is None else f'{ns:.0f}':>8s}"
        )
    print(
        f"shard ms per step (median) {r['shard_ms_per_step']:.3f}; requests per worker per shard "
        f"{r['requests_per_worker_per_shard']:.2f} ({r['sections_per_request']:.2f} op sections each, one flat "
        f"part per section); {r['per_request_us']:.0f} us per request; {r['shard_ns_per_row']:.0f} ns per row vs "
        f"numba limit {r['numba_limit_ns_per_row']:.0f} ns ({r['ratio_vs_numba_limit']:.1f}x)"
    )
    if len(r["repeats"]) > 1:
        print(
            f"medians of {len(r['repeats'])} repeats; each repeat's ratio to its own limit: "
            + ", ".join(f"{x['ratio_vs_numba_limit']:.2f}x" for x in r["repeats"])
        )


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
