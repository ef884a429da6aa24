"""Report sections of wire compression and training groups (docs/compression.md).

- ``compression``: embedding bytes per transmission cause as fp32 rows and as they go on
  the wire with ``--wire-dtype`` (NOTE [wire compression]: each embedding or gradient row
  of ``dim`` values costs :func:`herald.ps.compress.row_bytes`; keys and optimizer state
  are the same in both and left out).
- ``groups``: NOTE [training groups]: per group, averaging rounds and the lag in steps
  between a replica's read and its averaged write, from the leaders' ``groups-rank<r>.json``.
- ``group_streams``: NOTE [independent groups] (herald/job/group_dispatch.py): per group's
  dispatcher, its steps, samples, samples/s and the shared stream's batches it took.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from herald.ps.compress import row_bytes


def compression(cfg: Any, by_cause: dict[str, int]) -> dict[str, Any]:
    """``{"wire_dtype", "dense_comm", "per_cause": {cause: {"fp32": bytes, "wire": bytes}},
    "fp32_bytes", "wire_bytes", "ratio"}`` for the transmission counts ``by_cause``."""
    wire = cfg.comm.wire_dtype
    full, packed = row_bytes("fp32", cfg.embedding.dim), row_bytes(wire, cfg.embedding.dim)
    per = {c: {"fp32": n * full, "wire": n * packed} for c, n in by_cause.items()}
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


def fix_group_samples(rep: dict[str, Any], merged: list, batch_rows: int, train_s: float) -> None:
    """Correct ``samples``, ``samples_per_second`` (steady: first to last ack of the job's
    merged steps) and ``wall_samples_per_second`` of a report whose steps are the groups'
    steps of ``batch_rows`` samples each (NOTE [independent groups]), in place."""
    n = len(merged)
    steady_s = merged[-1].acked_at - merged[0].acked_at if n > 1 else 0.0
    rep["samples"] = n * batch_rows
    rep["samples_per_second"] = (n - 1) * batch_rows / steady_s if steady_s > 0 else float("nan")
    rep["wall_samples_per_second"] = n * batch_rows / train_s if train_s > 0 else float("nan")


def format_lines(rep: dict[str, Any]) -> list[str]:
    """Report text lines of both sections (nothing for fp32 and one group)."""
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
    grp = rep.get("groups")
    if grp:
        for s in grp["leaders"]:
            lines.append(
                f"group {s['group']} (ranks {s['ranks'][0]}-{s['ranks'][-1]}): {s['rounds']} EASGD rounds "
                f"(alpha {grp['easgd_alpha']}, every {grp['average_every']} steps), "
                f"{s['corrections']} applied, lag mean {s['lag_steps_mean']:.1f} / max "
                f"{s['lag_steps_max']} steps"
                + ("" if s.get("thread_ended", True) else "; its averaging thread did not end in time")
            )
        if not grp["leaders"]:
            lines.append(f"groups {grp['groups']}: no averaging statistics were written by the group leaders")
    streams = rep.get("group_streams")
    if streams:
        lines.append(
            "one dispatcher per group (NOTE [independent groups]): "
            + "; ".join(
                f"group {s['group']} {s['steps']} steps, {s['samples']:,} samples, {s['samples_per_second']:,.0f} "
                f"samples/s, final train loss {s['final_loss']:.4f}"
                for s in streams["groups"]
            )
        )
    return lines
