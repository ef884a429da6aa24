"""The report's blocks of communication (docs/compression.md) and training groups.

- ``transmissions``: embedding rows moved per cause (the plan's counts; the rows a bounded
  read took from the cache are not pulls; a mode without a plan, hybrid, pulls every row read
  and pushes gradients per key) and ``wire_bytes`` as the acks counted them;
- ``ps_requests``: :func:`ps_requests`;
- ``compression``: embedding bytes per transmission cause as fp32 rows and as they go on
  the wire with ``--wire-dtype`` (NOTE [wire compression]: each embedding or gradient row
  of ``dim`` values costs :func:`herald.ps.compress.row_bytes`; keys and optimizer state
  are the same in both and left out);
- ``groups``: NOTE [training groups]: per group, averaging rounds and the lag in steps
  between a replica's read and its averaged write, from the leaders' ``groups-rank<r>.json``;
- ``group_streams``: NOTE [independent groups] (herald/job/group_dispatch.py): per group's
  dispatcher, its steps, samples, samples/s and the shared stream's batches it took.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from herald.contracts.modes import consistency_mode
from herald.contracts.plan import CAUSES
from herald.dispatch.records import StepRecord
from herald.job.report.consistency import consistency_block
from herald.job.report.inputs import ReportInputs
from herald.job.report.progress import PULLS, PUSHES
from herald.ps.compress import row_bytes


def by_cause(inp: ReportInputs) -> dict[str, int]:
    """Embedding rows moved per cause of :data:`herald.contracts.plan.CAUSES` over this attempt:
    the plan's counts less the stale reads a bounded mode took from the cache; under a mode
    that plans no transmissions (hybrid) every row read is a pull and every gradient row a push."""
    counts = (
        np.sum([r.counts.sum(axis=0) for r in inp.records], axis=0) if inp.records else np.zeros(len(CAUSES), np.int64)
    )
    moved = {c: int(v) for c, v in zip(CAUSES, counts)}
    consistency = consistency_block(inp.cfg, inp.records)
    moved["update_pull"] -= consistency["stale_reads"]  # planned, but read from the cache (bounded)
    if not consistency_mode(consistency["mode"]).planned_transmissions:
        # hybrid: no plan runs, every row read is pulled, gradients pushed per key
        moved = {
            **dict.fromkeys(moved, 0),
            "miss_pull": consistency["reads"],
            "grad_push": consistency["gradient_rows_pushed"],
        }
    return moved


def transmissions_fields(inp: ReportInputs) -> dict[str, Any]:
    """``transmissions`` (:func:`by_cause`, ``pulls``, ``pushes``, ``total`` and their
    ``embedding_bytes`` as fp32 rows of the job's one width; None where the tables' widths
    differ: the rows are counted, not their tables) and ``wire_bytes`` (``pulled``, ``pushed``,
    ``allreduced``, ``dense``: what the workers' acks counted, every width as it went)."""
    moved = by_cause(inp)
    dims = {t.dim for t in inp.tables} or {inp.cfg.embedding.dim}
    pulls, pushes = sum(moved[c] for c in PULLS), sum(moved[c] for c in PUSHES)
    recs = inp.records
    return {
        "transmissions": {
            **moved,
            "pulls": pulls,
            "pushes": pushes,
            "total": pulls + pushes,
            "embedding_bytes": (pulls + pushes) * dims.pop() * 4 if len(dims) == 1 else None,
        },
        "wire_bytes": {
            "pulled": int(sum(r.bytes_pulled for r in recs)),
            "pushed": int(sum(r.bytes_pushed for r in recs)),
            "allreduced": int(sum(r.bytes_allreduced for r in recs)),
            "dense": int(sum(r.bytes_dense for r in recs)),
        },
    }


def transmissions_lines(rep: dict[str, Any]) -> list[str]:
    tx, wire = rep["transmissions"], rep["wire_bytes"]
    return [
        "transmissions: " + "  ".join(f"{c} {tx[c]:,}" for c in CAUSES),
        f"  pulls {tx['pulls']:,}  pushes {tx['pushes']:,}  total {tx['total']:,}  "
        + (
            f"({tx['embedding_bytes'] / 2**20:.1f} MiB of embeddings)"
            if tx.get("embedding_bytes") is not None
            else "(tables of several widths)"
        )
        + "; on the wire: pulled "
        f"{wire['pulled'] / 2**20:.1f} MiB, pushed {wire['pushed'] / 2**20:.1f} MiB"
        + (
            f" (each with {wire['dense'] / 2**20:.1f} MiB of dense gradients, summed on the shards)"
            if wire["dense"]
            else ""
        )
        + (f"; replicated tables all-reduced {wire['allreduced'] / 2**20:.1f} MiB" if wire["allreduced"] else ""),
    ]


def transmissions_plot(ax: Any, rep: dict[str, Any], records: Sequence[StepRecord]) -> None:
    """The report.png panel of the embeddings moved per step, per cause (the plan's counts)."""
    steps = [r.step for r in records]
    per_cause = np.array([r.counts.sum(axis=0) for r in records])
    for c in PULLS + PUSHES:
        ax.plot(steps, per_cause[:, CAUSES.index(c)], lw=0.8, label=c)
    ax.set(xlabel="step", ylabel="embeddings moved", title=f"transmissions per step [{rep['config']['schedule']}]")
    ax.legend(fontsize=8)


def ps_requests(records: Sequence[StepRecord], workers: int, shards: int) -> dict[str, Any]:
    """The report's ``ps_requests`` (int: every request the workers sent to any PS shard,
    from the acks' ``ps_requests``) and ``ps_requests_per_worker_per_shard_per_step``
    (float: that total / (``workers`` x ``shards`` x steps), ``workers`` those acking each
    record; 0.0 without steps). E.g. 2 workers, 2 shards, 3 steps of 8 requests each
    (every worker sends one request per shard, twice a step): 24 / 12 = 2.0."""
    total = int(sum(r.ps_requests for r in records))
    denominator = len(records) * workers * shards
    return {
        "ps_requests": total,
        "ps_requests_per_worker_per_shard_per_step": total / denominator if denominator else 0.0,
    }


def ps_requests_fields(inp: ReportInputs) -> dict[str, Any]:
    """:func:`ps_requests` over the workers acking each step and the shards."""
    return ps_requests(inp.records, inp.workers_per_step, inp.shards)


def ps_requests_lines(rep: dict[str, Any]) -> list[str]:
    return [
        f"PS requests {rep['ps_requests']:,}: {rep['ps_requests_per_worker_per_shard_per_step']:.2f} "
        "per worker per shard per step"
    ]


def compression(cfg: Any, moved: dict[str, int]) -> dict[str, Any]:
    """``{"wire_dtype", "dense_comm", "per_cause": {cause: {"fp32": bytes, "wire": bytes}},
    "fp32_bytes", "wire_bytes", "ratio"}`` for the transmission counts ``moved`` (rows per cause)."""
    wire = cfg.comm.wire_dtype
    full, packed = row_bytes("fp32", cfg.embedding.dim), row_bytes(wire, cfg.embedding.dim)
    per = {c: {"fp32": n * full, "wire": n * packed} for c, n in moved.items()}
    fp32 = sum(v["fp32"] for v in per.values())
    sent = sum(v["wire"] for v in per.values())
    return {
        "wire_dtype": wire,
        "dense_comm": cfg.comm.dense_comm,
        "per_cause": per,
        "fp32_bytes": fp32,
        "wire_bytes": sent,
        "ratio": fp32 / sent if sent else 1.0,
    }


def compression_fields(inp: ReportInputs) -> dict[str, Any]:
    """``compression``: :func:`compression` of the pulls and pushes."""
    moved = by_cause(inp)
    return {"compression": compression(inp.cfg, {c: moved[c] for c in PULLS + PUSHES})}


def compression_lines(rep: dict[str, Any]) -> list[str]:
    """The wire compression and dense all-reduce lines (none for fp32)."""
    lines = []
    comp = rep.get("compression")
    if comp and comp["wire_dtype"] != "fp32":
        lines.append(
            f"wire compression {comp['wire_dtype']} (PS accumulates fp32): embedding bytes "
            f"{comp['fp32_bytes'] / 2**20:.2f} MiB as fp32 -> {comp['wire_bytes'] / 2**20:.2f} MiB on the "
            f"wire ({comp['ratio']:.2f}x fewer); per cause fp32 -> wire: "
            + ", ".join(
                f"{c} {v['fp32'] / 2**10:.0f} -> {v['wire'] / 2**10:.0f} KiB"
                for c, v in comp["per_cause"].items()
                if v["fp32"]
            )
        )
    if comp and comp["dense_comm"] != "fp32":
        lines.append(f"dense all-reduce payload {comp['dense_comm']}")
    return lines


def groups(cfg: Any) -> dict[str, Any] | None:
    """The groups' averaging statistics (None with one group), from the run folder."""
    if cfg.groups.count <= 1:
        return None
    leaders = []
    for path in sorted(pathlib.Path(cfg.run_dir).glob("groups-rank*.json")):
        stats = json.loads(path.read_text())
        if stats.get("leader") == int(path.stem.split("rank")[-1]):  # the group's own figures
            leaders.append(stats)
    return {
        "groups": cfg.groups.count,
        "average_every": cfg.groups.average_every,
        "easgd_alpha": cfg.groups.easgd_alpha,
        "leaders": leaders,
    }


def groups_fields(inp: ReportInputs) -> dict[str, Any]:
    """``groups``: :func:`groups`."""
    return {"groups": groups(inp.cfg)}


def groups_lines(rep: dict[str, Any]) -> list[str]:
    grp = rep.get("groups")
    if not grp:
        return []
    lines = [
        f"group {s['group']} (ranks {s['ranks'][0]}-{s['ranks'][-1]}): {s['rounds']} EASGD rounds "
        f"(alpha {grp['easgd_alpha']}, every {grp['average_every']} steps), "
        f"{s['corrections']} applied, lag mean {s['lag_steps_mean']:.1f} / max "
        f"{s['lag_steps_max']} steps"
        + ("" if s.get("thread_ended", True) else "; its averaging thread did not end in time")
        for s in grp["leaders"]
    ]
    if not grp["leaders"]:
        lines.append(f"groups {grp['groups']}: no averaging statistics were written by the group leaders")
    return lines


def group_streams_fields(inp: ReportInputs) -> dict[str, Any]:
    """``group_streams`` with one dispatcher per group (nothing with one dispatcher)."""
    return {} if inp.groups is None else {"group_streams": inp.groups.summary}


def group_streams_lines(rep: dict[str, Any]) -> list[str]:
    streams = rep.get("group_streams")
    if not streams:
        return []
    return [
        "one dispatcher per group (NOTE [independent groups]): "
        + "; ".join(
            f"group {s['group']} {s['steps']} steps, {s['samples']:,} samples, {s['samples_per_second']:,.0f} "
            f"samples/s, final train loss {s['final_loss']:.4f}"
            for s in streams["groups"]
        )
    ]
