"""The report's blocks of what the job cost: the PS rows a bounded PS evicted, the scheduler's
time (and adaptive LAIA's k, Herald §4.3), and the job's CPU time per trained sample."""

from __future__ import annotations

from typing import Any

import numpy as np

from herald.job.report.evaluate import evictions
from herald.job.report.inputs import ReportInputs


def cpu_time(
    cpu_s: float, samples: int, scope: str, steady_s: float | None = None, steady_samples: int = 0
) -> dict[str, Any]:
    """The report's ``cpu_seconds`` (user + sys CPU seconds of the processes ``scope``
    names: :func:`herald.procs.cpu_seconds` over the job), ``cpu_us_per_sample``
    (microseconds per trained sample; nan without samples), ``cpu_scope``, and
    ``steady_cpu_us_per_sample``: ``steady_s`` seconds (NOTE [steady cpu] in
    herald/job/serving.py: the CPU from the first step to the end of serving) over the
    ``steady_samples`` of the steps after the first (nan without them)."""
    steady = 1e6 * steady_s / steady_samples if steady_s is not None and steady_samples else float("nan")
    return {
        "cpu_seconds": float(cpu_s),
        "cpu_us_per_sample": 1e6 * cpu_s / samples if samples else float("nan"),
        "cpu_scope": scope,
        "steady_cpu_us_per_sample": steady,
    }


def evictions_fields(inp: ReportInputs) -> dict[str, Any]:
    """``ps_evicted_rows``, ``ps_evicted_rows_read_again``: :func:`evictions` of the shards' stats
    taken after training (the evaluation's own are in ``metrics``)."""
    return evictions(inp.ps_stats)


def evictions_lines(rep: dict[str, Any]) -> list[str]:
    m = rep["metrics"]
    if not (rep.get("ps_evicted_rows") or m.get("ps_evicted_rows")):
        return []
    return [
        "PS rows evicted by --ps-max-rows (least recently used; an evicted row read again is "
        "re-initialised): "
        + "; ".join(
            f"{name} {d.get('ps_evicted_rows', 0):,} evicted, {d.get('ps_evicted_rows_read_again', 0):,} read again"
            for name, d in (("training", rep), ("evaluation", m))
        )
    ]


def scheduler_fields(inp: ReportInputs) -> dict[str, Any]:
    """``scheduling_ms`` (median and p99 of a step's schedule) and ``scheduler``
    (:meth:`herald.job.data.JobData.scheduler_stats`: threads, and with ``--scheduling-budget``
    adaptive LAIA's k over the job)."""
    ms = [r.schedule_ms for r in inp.records]
    return {
        "scheduling_ms": {
            "median": float(np.median(ms)) if ms else 0.0,
            "p99": float(np.percentile(ms, 99)) if ms else 0.0,
        },
        "scheduler": inp.scheduler,
    }


def scheduler_lines(rep: dict[str, Any]) -> list[str]:
    """The report line of adaptive LAIA (Herald §4.3): the budget and k over the job."""
    ad = (rep.get("scheduler") or {}).get("adaptive")
    if not ad or not ad.get("k"):
        return []
    k = ad["k"]
    budget = "no budget yet" if ad["budget_ms"] is None else f"{ad['budget_ms']:.2f} ms"
    if ad["mode"] == "auto" and ad["period_ms_median"] is not None:
        budget += f" = {ad['fraction']:g} x step period {ad['period_ms_median']:.2f} ms"
    line = (
        f"adaptive LAIA ({ad['mode']} budget: {budget}): tables scored k first {k['first']}, min {k['min']}, "
        f"median {k['median']}, max {k['max']}, final {k['final']} of {ad['num_tables']}"
    )
    if ad["budget_unreachable"]:
        line += (
            f"; budget unreachable on {ad['budget_unreachable']:,} of {ad['steps']:,} steps (even k = 1 "
            "would not fit: k kept)"
        )
    return [line]


def cpu_fields(inp: ReportInputs) -> dict[str, Any]:
    """:func:`cpu_time` of this attempt (its samples; the steady figure over the steps after the
    first, ``--workers`` x ``--batch-size`` samples each); nothing when the CPU was not measured."""
    if inp.cpu is None:
        return {}
    steady_samples = max(0, inp.steps - 1) * inp.cfg.global_batch
    return cpu_time(inp.cpu.seconds, inp.samples, inp.cpu.scope, inp.cpu.steady_s, steady_samples)


def cpu_lines(rep: dict[str, Any]) -> list[str]:
    if "cpu_seconds" not in rep:
        return []
    steady = rep.get("steady_cpu_us_per_sample", float("nan"))
    return [
        f"CPU time {rep['cpu_seconds']:.1f} s, {rep['cpu_us_per_sample']:.1f} us per trained sample"
        + (f" ({steady:.1f} in steady training: start-up, evaluation and report out)" if steady == steady else "")
        + f": {rep['cpu_scope']}"
    ]
