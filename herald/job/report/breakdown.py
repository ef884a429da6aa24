"""Where the time of a job goes: worker phases per step, dispatcher stages, PS shards.

Inputs are what the roles measure themselves (:mod:`herald.phases`): each worker's
phases travel with its ack (``StepRecord.phases_ms``, the mean over the workers), the
dispatcher's stages are its own timer, and every PS shard reports its busy seconds per
op in ``stats``. The result goes into the report (text, JSON, the PNG's stacked bars)
and into ``herald bench scale``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from herald.job.report.inputs import ReportInputs
from herald.phases import DISPATCHER_PHASES, WORKER_PHASES, ordered


def phase_breakdown(
    records: Sequence[Any],
    train_s: float,
    dispatcher_s: dict[str, float] | None = None,
    ps_stats: Sequence[dict] | None = None,
    job_s: float | None = None,
) -> dict[str, Any]:
    """The breakdown of a job (JSON-able).

    Args:
        records: the job's ``StepRecord`` s (``phases_ms``: mean over workers, ms).
        train_s: wall-clock seconds of training (steady: first to last ack).
        dispatcher_s: seconds per dispatcher stage over the whole job.
        ps_stats: one ``stats`` dict per PS shard (with ``busy_s`` per op, whole job).
        job_s: wall-clock seconds of the whole job, over which ``dispatcher_s`` and the
            shards' ``busy_s`` were counted (start-up and the first step in); default
            ``train_s``. Dividing whole-job busy seconds by the steady seconds overstated
            them: a 4-step job's first schedule (kernels loading) read as 17,000%.

    Returns:
        ``{"worker_ms_per_step": {phase: mean ms}, "worker_step_ms": sum of those,
        "wall_ms_per_step": train_s / steps, "dispatcher_busy": {stage: fraction of
        job_s}, "ps_busy": [{"shard", "busy", "by_op": {op: fraction of job_s}}]}``; a
        shard that released step messages also has ``"step_barrier"``, its stats of
        them (NOTE [step barrier timing] in herald/ps/stepped.py).
    """
    busy_over = job_s if job_s is not None and job_s > 0 else train_s
    out: dict[str, Any] = {}
    with_phases = [r.phases_ms for r in records if getattr(r, "phases_ms", None)]
    if with_phases:
        names = {k for p in with_phases for k in p}
        per = {k: float(np.mean([p.get(k, 0.0) for p in with_phases])) for k in names}
        out["worker_ms_per_step"] = {k: round(v, 3) for k, v in ordered(per, WORKER_PHASES).items() if v > 0}
        out["worker_step_ms"] = round(sum(out["worker_ms_per_step"].values()), 3)
    if records and train_s > 0:
        out["wall_ms_per_step"] = round(train_s * 1e3 / len(records), 3)
    if dispatcher_s and busy_over > 0:
        out["dispatcher_busy"] = {
            k: round(v / busy_over, 4) for k, v in ordered(dispatcher_s, DISPATCHER_PHASES).items()
        }
    if ps_stats and busy_over > 0:
        shards = []
        for s in ps_stats:
            busy = s.get("busy_s", {})
            by_op = {op: round(v / busy_over, 4) for op, v in sorted(busy.items(), key=lambda kv: -kv[1]) if v > 0}
            shard = {"shard": s.get("shard"), "busy": round(sum(busy.values()) / busy_over, 4), "by_op": by_op}
            if (s.get("step_barrier") or {}).get("released"):  # NOTE [step barrier timing] in herald/ps/stepped.py
                shard["step_barrier"] = s["step_barrier"]
            shards.append(shard)
        out["ps_busy"] = shards
    return out


def format_breakdown(b: dict[str, Any]) -> list[str]:
    """Report lines for :func:`phase_breakdown`'s result."""
    lines = []
    if "worker_ms_per_step" in b:
        phases = "  ".join(f"{k} {v:.2f}" for k, v in b["worker_ms_per_step"].items())
        lines.append(
            f"worker step {b['worker_step_ms']:.2f} ms (mean per phase and over workers; wall "
            f"{b.get('wall_ms_per_step', float('nan')):.2f} ms/step): {phases}"
        )
    if "dispatcher_busy" in b:
        busy = {k: v for k, v in b["dispatcher_busy"].items() if not k.startswith("wait")}
        lines.append(
            f"dispatcher stages (each on its thread) busy {100 * sum(busy.values()):.0f}% of the job's time in all: "
            + "  ".join(f"{k} {100 * v:.0f}%" for k, v in b["dispatcher_busy"].items())
        )
    for s in b.get("ps_busy", []):
        lines.append(
            f"PS shard {s['shard']} busy {100 * s['busy']:.0f}%: "
            + "  ".join(f"{k} {100 * v:.0f}%" for k, v in s["by_op"].items())
        )
        if "step_barrier" in s:
            lines.append("  " + format_barrier(s["step_barrier"]))
    return lines


def format_barrier(st: dict[str, Any]) -> str:
    """A report line for a shard's step barrier stats (NOTE [step barrier timing] in
    herald/ps/stepped.py): how far apart the ranks' step messages came, which rank came
    last how often, and the release."""
    last = st.get("last_rank", {})
    n = max(1, sum(last.values()))
    shares = ", ".join(f"rank {r} {100 * c / n:.0f}%" for r, c in sorted(last.items(), key=lambda kv: -kv[1])[:4])
    return (
        f"step barrier over {st['released']:,} steps: the ranks' messages came {st['spread_ms_mean']:.2f} ms apart "
        f"(first to last, mean; max {st['spread_ms_max']:.1f} ms), then the release took "
        f"{st['release_ms_mean']:.2f} ms; last to come: {shares}"
    )


def plot_breakdown(ax: Any, b: dict[str, Any]) -> None:
    """A stacked bar of the worker's step phases (ms) and the dispatcher's stages
    (ms per step) on the matplotlib axes ``ax``."""
    bars = []
    if "worker_ms_per_step" in b:
        bars.append(("worker", b["worker_ms_per_step"]))
    if "dispatcher_busy" in b and "wall_ms_per_step" in b:
        bars.append(("dispatcher", {k: v * b["wall_ms_per_step"] for k, v in b["dispatcher_busy"].items()}))
    if not bars:
        ax.set_axis_off()
        return
    cmap = __import__("matplotlib").colormaps["tab20"]
    names = list(dict.fromkeys(k for _, d in bars for k in d))
    for x, (_label, d) in enumerate(bars):
        bottom = 0.0
        for i, k in enumerate(names):
            v = d.get(k, 0.0)
            if v > 0:
                ax.bar(x, v, bottom=bottom, color=cmap(i % 20), label=k)
                bottom += v
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper right")
    ax.set_xticks(range(len(bars)), [label for label, _ in bars])
    ax.set(ylabel="ms per step", title="where a step goes")
    if "wall_ms_per_step" in b:
        ax.axhline(b["wall_ms_per_step"], color="k", lw=0.8, ls="--")


def phases_fields(inp: ReportInputs) -> dict[str, Any]:
    """The report's ``phases``: :func:`phase_breakdown` over the steady span (the whole
    training time with fewer than two steps), busy fractions over the whole job."""
    return {
        "phases": phase_breakdown(
            inp.records, inp.steady_s or inp.train_s, inp.dispatcher_s, inp.ps_stats, job_s=inp.train_s
        )
    }


def phases_lines(rep: dict[str, Any]) -> list[str]:
    return format_breakdown(rep.get("phases", {}))


def phases_plot(ax: Any, rep: dict[str, Any], records: Sequence[Any]) -> None:
    """The report.png panel: :func:`plot_breakdown`."""
    plot_breakdown(ax, rep.get("phases", {}))
