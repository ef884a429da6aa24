"""``herald bench network``: vanilla, laia, plan, herald and costaware across hosts with
shaped links, on the multi-host test bed (docs/testbed.md), in one run.

Herald's speedup (Herald §6.3: 1.09-2.11x over HET on TCP) comes from moving
fewer embeddings over a network that costs something; on loopback moving fewer bytes
saves almost nothing. Here every schedule trains the same job on the same bed: a PS
host, a dispatcher host and ``--workers`` worker hosts (one torchrun worker each), each
host link shaped to ``--rate`` and ``--delay`` ms per direction (NOTE [test bed
network]), with real TCP between them (NOTE [test bed job]). Reported per schedule and
embedding dim: steady samples/s, the speedup over vanilla in the same run, the bytes
between workers and PS on the wire (and per cause, in embeddings moved), the all-reduce
bytes, and the held-out AUC (BSP is exact, so every schedule trains the same model: the
AUCs agree to float rounding). Needs root, ``ip`` and ``tc``; an explicit ``--delay`` > 0
needs the ``netem`` qdisc, and the default delay (0.2 ms) is dropped with a warning and a
``delay_note`` in the JSON where the kernel lacks it (NOTE [test bed delay]).

At 1 Gbit/s two workers on two shared cores are CPU-bound and moving fewer bytes saves
little; ``--rate 100mbit --dim 512`` (or 50mbit) makes the PS link the bottleneck, and
``--cache-ratio 0.3`` cuts herald's write-backs (docs/testbed.md, "A network-bound
regime").

Beside them, in the same run (unless ``--no-torchrec``), the TorchRec baseline at each dim
(:mod:`herald.bench.torchrec_baseline`): single-process TorchRec DLRM over FBGEMM's fused
table-batched embeddings, 1 thread, outside the bed (no network in it), on the same rows,
sparse optimizer and ``--batch-size`` (one worker's batch); each run's samples/s is also
given as a ratio to it (``vs_torchrec``). Without torchrec the JSON's ``"torchrec"`` says
``{"error": "torchrec not installed: make torchrec"}``. Run as ``herald bench network``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from herald.bench import torchrec_baseline
from herald.bench.common import summarize
from herald.contracts.plan import CAUSES
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.testbed import TestBed
from herald.testbed.job import bed_hosts, run_job


def run(args: argparse.Namespace) -> dict:
    """Run every schedule at every dim on one bed; print the table, write ``--out``.

    Raises:
        ConfigError: bad options. TestBedError: the bed cannot be built here (the
            message names the fix). HeraldError: a job failed (its role named).
    """
    if not args.schedules or "vanilla" not in args.schedules:
        raise ConfigError("--schedules must include vanilla: the speedups are measured against it in the same run")
    torchrec_baseline.check_bench_optimizer(args.optimizer, args.no_torchrec)
    source = args.source or f"synthetic://criteo?rows={args.rows}&seed=1"
    run_dir = pathlib.Path(args.run_dir).resolve()
    runs = []
    with TestBed(bed_hosts(args.workers), rate=args.rate, delay_ms=args.delay, log_dir=run_dir / "logs") as bed:
        print(bed.describe(), flush=True)
        for dim in args.dim:
            for schedule in args.schedules:
                tag = f"{schedule}-d{dim}"
                cfg = TrainConfig.from_flags(
                    source=source,
                    schedule=schedule,
                    workers=args.workers,
                    batch_size=args.batch_size,
                    cache_ratio=args.cache_ratio,
                    embedding_dim=dim,
                    optimizer=args.optimizer,
                    eval_fraction=args.eval_fraction,
                    run_dir=str(run_dir / tag),
                )
                print(f"--- {schedule}, dim {dim}, {args.workers} worker hosts", flush=True)
                runs.append(_row(schedule, dim, run_job(bed, cfg, tag=tag, timeout_s=args.timeout_s)))
        bed_record = describe_bed(bed, args.workers)
    trec = None if args.no_torchrec else torchrec_per_dim(source, args)
    _compare(runs, trec)
    result = {
        "runs": runs,
        "bed": bed_record,
        "torchrec": trec,
        "job": {
            "source": source,
            "batch_size": args.batch_size,
            "cache_ratio": args.cache_ratio,
            "optimizer": args.optimizer,
            "eval_fraction": args.eval_fraction,
        },
    }
    print(format_table(result))
    out = pathlib.Path(args.out) if args.out else run_dir / "bench_network.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {out}")
    return result


def describe_bed(bed, worker_hosts: int) -> dict:
    """The bed's settings as the JSON records them: ``rate``, ``delay_ms`` (in effect),
    ``delay_note`` (why it is not the default 0.2 ms: NOTE [test bed delay]; ``""``
    when it is), ``worker_hosts``, ``workers_per_host``."""
    return {
        "rate": bed.rate,
        "delay_ms": bed.delay_ms,
        "delay_note": bed.delay_note,
        "worker_hosts": worker_hosts,
        "workers_per_host": 1,
    }


def _row(schedule: str, dim: int, rep: dict) -> dict:
    s = summarize(rep)
    return {
        "schedule": schedule,
        "dim": dim,
        "samples_per_s": s["samples_per_second"],
        "speedup_vs_vanilla": None,
        "bytes": s["wire_bytes"],
        "bytes_vs_vanilla": None,
        "auc": rep["metrics"].get("auc"),
        "allreduce_bytes": s["allreduce_bytes"],
        "embeddings_moved": s["embeddings_moved"],
        "by_cause": {c: rep["transmissions"][c] for c in CAUSES},
        "train_seconds": s["train_seconds"],
        "steps": s["steps"],
        "phases_ms": phase_split(rep["phases"]),
    }


#: worker phases spent on the network: PS pulls, PS push acks, the step message (NOTE
#: [step messages] in herald/ps/stepped.py: sent, then its round trip), the dense all-reduce
NETWORK_PHASES = ("pull", "push_wait", "step_send", "step_wait", "dense_allreduce")


def phase_split(phases: dict) -> dict:
    """A worker step's mean time, ms, split into the network phases of
    :data:`NETWORK_PHASES` and ``other`` (the sum of the rest: lookup, forward,
    backward, local updates, ...), from a report's ``phases`` (``worker_step_ms``,
    ``worker_ms_per_step``)."""
    per = phases.get("worker_ms_per_step", {})
    split = {"step": phases.get("worker_step_ms", 0.0), **{p: per.get(p, 0.0) for p in NETWORK_PHASES}}
    split["other"] = sum(v for p, v in per.items() if p not in NETWORK_PHASES)
    return split


def torchrec_per_dim(source: str, args: argparse.Namespace) -> dict:
    """``{str(dim): TorchRec entry}`` (:func:`herald.bench.torchrec_baseline.torchrec_on_source`)
    for each ``--dim``, on the training split the jobs train on; ``{"error": ...}`` when
    torchrec is missing."""
    missing = torchrec_baseline.torchrec_import_error()
    if missing:
        print(f"TorchRec: {missing}", flush=True)
        return {"error": missing}
    return {
        str(dim): torchrec_baseline.torchrec_on_source(
            source,
            batch_size=args.batch_size,
            eval_fraction=args.eval_fraction,
            embedding_dim=dim,
            optimizer=args.optimizer,
        )
        for dim in args.dim
    }


def _compare(runs: list[dict], trec: dict | None = None) -> None:
    """Fill each run's ratios against vanilla at the same dim, and against TorchRec at that dim."""
    for r in runs:
        r["vs_torchrec"] = torchrec_baseline.ratio_to((trec or {}).get(str(r["dim"])), r["samples_per_s"])
        base = next(b for b in runs if b["schedule"] == "vanilla" and b["dim"] == r["dim"])
        r["speedup_vs_vanilla"] = r["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else None
        r["bytes_vs_vanilla"] = r["bytes"] / base["bytes"] if base["bytes"] else None


def format_table(result: dict) -> str:
    """The results as a Markdown table, one row per (dim, schedule), then the TorchRec
    baseline per dim (when the result has one) and the phase table."""
    causes = [c for c in CAUSES if c != "hit"]
    bed = result["bed"]
    note = f" ({bed['delay_note']})" if bed.get("delay_note") else ""
    lines = [
        (
            f"\n{bed['worker_hosts']} worker hosts x 1 worker, links {bed['rate']} and {bed['delay_ms']:g} ms "
            f"per direction{note}; batch {result['job']['batch_size']} per worker"
        ),
        "| dim | schedule | samples/s | speedup vs vanilla | worker<->PS MiB | bytes vs vanilla | "
        + " | ".join(causes)
        + " | all-reduce MiB | AUC | vs TorchRec |",
        "|---" * (9 + len(causes)) + "|",
    ]
    for r in result["runs"]:
        auc = f"{r['auc']:.4f}" if r["auc"] is not None else "-"
        lines.append(
            f"| {r['dim']} | {r['schedule']} | {r['samples_per_s']:,.0f} | {r['speedup_vs_vanilla']:.2f}x | "
            f"{r['bytes'] / 2**20:,.1f} | {r['bytes_vs_vanilla']:.3f}x | "
            + " | ".join(f"{r['by_cause'][c]:,}" for c in causes)
            + f" | {r['allreduce_bytes'] / 2**20:,.1f} | {auc} | "
            f"{torchrec_baseline.format_ratio(r.get('vs_torchrec'))} |"
        )
    trec = result.get("torchrec")
    if trec is not None:
        lines += [""] + (
            [torchrec_baseline.describe(trec)]
            if "error" in trec
            else [f"dim {dim}: {torchrec_baseline.describe(entry)}" for dim, entry in trec.items()]
        )
    lines += [
        "\nworker step, mean ms per phase (network: " + ", ".join(NETWORK_PHASES) + ")",
        "| dim | schedule | step | " + " | ".join(NETWORK_PHASES) + " | other |",
        "|---" * (len(NETWORK_PHASES) + 4) + "|",
    ]
    for r in result["runs"]:
        ph = r.get("phases_ms") or {}
        lines.append(
            f"| {r['dim']} | {r['schedule']} | "
            + " | ".join(f"{ph.get(k, 0.0):,.0f}" for k in ("step", *NETWORK_PHASES, "other"))
            + " |"
        )
    return "\n".join(lines)
