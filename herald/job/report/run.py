"""The report's blocks of what ran: the settings, a signal's stop, the records skipped and the
messages dropped, the data, the throughput, the start-up, the model's metrics and the
replicated tables. Each block is a ``*_fields(inputs)`` (its report.json keys) and, where it
has report.txt lines, a ``*_lines(rep)`` (herald/job/report/blocks.py puts them together)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from herald.dispatch.records import StepRecord
from herald.job.report import attempts
from herald.job.report.inputs import ReportInputs
from herald.job.report.progress import format_skipped, progressive

#: the start-up milestones in order, with their words in report.txt (herald/job/serving.py StartupClock)
STARTUP_MILESTONES = (
    ("imported", "imported"),
    ("data_ready", "data ready"),
    ("ps_ready", "PS ready"),
    ("workers_ready", "workers ready"),
    ("first_step", "first step acked"),
)


def final_loss(records: Sequence[StepRecord]) -> float:
    """The report's ``final_loss``: the mean training loss of the last 10 acked steps (nan if none)."""
    return float(np.mean([r.loss for r in records[-10:]])) if records else float("nan")


def startup_line(startup: dict[str, float]) -> str:
    """report.txt's start-up line: each milestone reached, seconds after ``herald train`` started."""
    got = [f"{words} {startup[k]:.1f} s" for k, words in STARTUP_MILESTONES if k in startup]
    return "start-up (seconds after herald train started): " + (", ".join(got) if got else "not measured")


def config_fields(inp: ReportInputs) -> dict[str, Any]:
    """``config``: the job's settings (``source_options`` left out)."""
    return {"config": {k: v for k, v in inp.cfg.flags().items() if k != "source_options"}}


def config_lines(rep: dict[str, Any]) -> list[str]:
    cfg = rep["config"]
    return [
        f"schedule {cfg['schedule']}  workers {cfg['workers']}  batch {cfg['batch_size']}"
        f"  cache {rep['capacity_rows_per_worker']} rows/worker"
    ]


def interrupted_fields(inp: ReportInputs) -> dict[str, Any]:
    """``interrupted``: ``{"signal", "at_step" (steps trained, where --resume continues),
    "checkpoint" (its folder or None)}`` when a signal stopped the job; None: it ran to its end."""
    return {"interrupted": inp.interrupted}


def interrupted_lines(rep: dict[str, Any]) -> list[str]:
    stop = rep.get("interrupted")
    if not stop:
        return []
    written = (
        f"checkpoint {stop['checkpoint']} written: continue with --resume)"
        if stop.get("checkpoint") is not None
        else "no checkpoint)"
    )
    return [f"interrupted at step {stop['at_step']} by {stop['signal']} ({stop['at_step']} steps trained; " + written]


def skipped_fields(inp: ReportInputs) -> dict[str, Any]:
    """``skipped``: the bad records skipped per split and reason (NOTE [bad records])."""
    return {"skipped": {split: dict(inp.skipped.get(split, {})) for split in ("train", "eval")}}


def skipped_lines(rep: dict[str, Any]) -> list[str]:
    lines = []
    for split, counts in (rep.get("skipped") or {}).items():
        if any(counts.values()):
            name = {"train": "training", "eval": "held-out"}.get(split, split)
            lines.append(f"bad records skipped ({name} split): {sum(counts.values()):,} ({format_skipped(counts)})")
    return lines


def rejected_fields(inp: ReportInputs) -> dict[str, Any]:
    """``rejected``: the messages the dispatcher dropped per kind (NOTE [peer validation] in
    herald/dispatch/peers.py), the last record's totals."""
    return {"rejected": dict(inp.records[-1].rejected) if inp.records else {}}


def rejected_lines(rep: dict[str, Any]) -> list[str]:
    if not any((rep.get("rejected") or {}).values()):
        return []
    return [
        "messages the dispatcher dropped (malformed, or from peers that are not this job's workers): "
        + ", ".join(f"{k} {n:,}" for k, n in rep["rejected"].items() if n)
        + " (docs/operations.md)"
    ]


def data_fields(inp: ReportInputs) -> dict[str, Any]:
    """``capacity_rows_per_worker``, ``split`` (the rows of each split) and ``data`` (the producer's info)."""
    return {"capacity_rows_per_worker": int(inp.capacity_rows), "split": inp.split_info, "data": inp.batches_info}


def throughput_fields(inp: ReportInputs) -> dict[str, Any]:
    """``steps``, ``samples``, ``train_seconds`` and ``wall_samples_per_second`` over every attempt
    (:func:`herald.job.report.attempts.totals`); ``samples_per_second``, the steady throughput
    of this attempt (the samples of steps 1..n over the time from step 0's ack to step n's:
    start-up, the first step's compilation and the evaluation are not in it);
    ``startup_seconds`` (``train_seconds`` less that span) and ``final_loss`` (this attempt's)."""
    every = attempts.totals(inp)
    return {
        "steps": every["steps"],
        "samples": every["samples"],
        "train_seconds": every["train_seconds"],
        "samples_per_second": inp.samples_per_second,
        "wall_samples_per_second": every["wall_samples_per_second"],
        "startup_seconds": max(0.0, inp.train_s - inp.steady_s) if inp.steps > 1 else inp.train_s,
        "final_loss": final_loss(inp.records),
    }


def throughput_lines(rep: dict[str, Any]) -> list[str]:
    return [
        f"steps {rep['steps']}  samples {rep['samples']:,}  time {rep['train_seconds']:.1f} s "
        f"(start-up {rep['startup_seconds']:.1f} s)  throughput {rep['samples_per_second']:,.0f} samples/s "
        f"(wall {rep['wall_samples_per_second']:,.0f})  (not trained, partial last batch: "
        f"{rep['data']['dropped_samples']})",
        f"final train loss {rep['final_loss']:.4f}",
    ]


def startup_fields(inp: ReportInputs) -> dict[str, Any]:
    """``startup``: this attempt's start-up milestones (seconds)."""
    return {"startup": inp.startup}


def startup_lines(rep: dict[str, Any]) -> list[str]:
    grouped = " (the job's last 10 acks, whichever group's: each group's is below)" if rep.get("group_streams") else ""
    return [startup_line(rep.get("startup") or {}) + grouped]


def metrics_fields(inp: ReportInputs) -> dict[str, Any]:
    """``metrics`` (the held-out evaluation) and ``progressive_validation`` (AUC and log loss of
    the predictions made before each update)."""
    return {"metrics": inp.metrics, "progressive_validation": progressive(list(inp.records))}


def metrics_lines(rep: dict[str, Any]) -> list[str]:
    lines = []
    m = rep["metrics"]
    if m.get("eval_rows"):
        lines.append(
            f"held-out ({m['eval_rows']:,} rows): AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  "
            f"dense replicas equal: {m['dense_replicas_equal']}"
        )
    pv = rep["progressive_validation"]
    if pv["samples"]:
        lines.append(
            f"progressive validation ({pv['samples']:,} training samples, scored before each update): "
            f"AUC {pv['auc']:.4f}  logloss {pv['logloss']:.4f}"
        )
    return lines


def embeddings_fields(inp: ReportInputs) -> dict[str, Any]:
    """``embeddings``: the job's ``tables`` (name, dim, optimizer, lr) and ``features`` (name,
    table, pooling, max_length; NOTE [tables and features] in herald/contracts/features.py),
    and ``sequence_truncated``, the sequence bags longer than their feature's ``max_length``
    (the last ``max_length`` rows kept), summed over the workers' acks."""
    if not inp.tables:
        return {}
    truncated = sum(r.consistency.get("sequence_truncated", 0) for r in inp.records)
    return {
        "embeddings": {
            "tables": [
                {"name": t.name, "dim": t.dim, "optimizer": t.optimizer.name, "lr": t.optimizer.lr} for t in inp.tables
            ],
            "features": [f.to_dict() for f in inp.features],
            "sequence_truncated": int(truncated),
        }
    }


def embeddings_lines(rep: dict[str, Any]) -> list[str]:
    """One line of the tables and the features reading them, when the job declared any."""
    emb = rep.get("embeddings")
    if not emb or all(f["table"] == f["name"] and f["pooling"] == "sum" for f in emb["features"]):
        return []  # one sum-pooled table per feature: nothing the settings line does not say
    tables = {t["name"]: t for t in emb["tables"]}
    feats: dict[str, list] = {}
    for f in emb["features"]:
        feats.setdefault(f["table"], []).append(f)
    # a feature alone on a table of its name, sum-pooled, at the most common dim and optimizer: summarised
    plain = [n for n, fs in feats.items() if len(fs) == 1 and fs[0]["name"] == n and fs[0]["pooling"] == "sum"]
    shapes = [(tables[n]["dim"], tables[n]["optimizer"]) for n in plain]
    common = max(set(shapes), key=shapes.count) if shapes else None
    parts = []
    for name, t in tables.items():
        if name in plain and (t["dim"], t["optimizer"]) == common:
            continue
        shown = [
            f"{f['name']} ({f['pooling'] if f['pooling'] != 'none' else 'sequence of ' + str(f['max_length'])})"
            for f in feats[name]
        ]
        parts.append(f"{name} dim {t['dim']} {t['optimizer']}: {', '.join(shown)}")
    rest = sum(1 for n in plain if (tables[n]["dim"], tables[n]["optimizer"]) == common)
    if rest and common is not None:
        parts.append(f"{rest} more on tables of their own (dim {common[0]} {common[1]})")
    line = f"tables {len(tables)} for {len(emb['features'])} features: " + "; ".join(parts)
    if emb["sequence_truncated"]:
        line += f"; sequences truncated {emb['sequence_truncated']:,}"
    return [line]


def replicas_fields(inp: ReportInputs) -> dict[str, Any]:
    """``replicated_tables`` (names; NOTE [replicated tables]) and ``replica_rows_per_worker``."""
    return {"replicated_tables": list(inp.replicated_tables), "replica_rows_per_worker": inp.replica_rows}


def throughput_plot(ax: Any, rep: dict[str, Any], records: Sequence[StepRecord]) -> None:
    """The report.png panel of the loss: per step and, over many steps, its running mean."""
    steps = [r.step for r in records]
    losses = np.array([r.loss for r in records])
    ax.plot(steps, losses, lw=0.5, alpha=0.4, label="per step")
    window = max(1, len(losses) // 50)
    if window > 1:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, lw=1.5, label=f"mean of {window} steps")
    ax.legend(fontsize=8)
    ax.set(xlabel="step", ylabel="train loss (mean over workers)", title="loss")
