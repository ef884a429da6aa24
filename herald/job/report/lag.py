"""The report's ``lag`` block: how far a stream's reads were behind its end over the job
(NOTE [lag] in herald/loader/kafka/source.py; a source without an end, a file, has none)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from herald.dispatch.records import StepRecord
from herald.job.report.inputs import ReportInputs


def fields(inp: ReportInputs) -> dict[str, Any]:
    """``lag`` (:meth:`herald.loader.lag.LagHistory.summary`) when the source has one."""
    return {"lag": inp.lag} if inp.lag is not None else {}


def lines(rep: dict[str, Any]) -> list[str]:
    lag = rep.get("lag")
    if not lag:
        return []
    rec, ev = lag["records"], lag["event_time_s"]
    line = f"lag behind the stream's end: {rec['final_total']:,} records at the end (peak {rec['peak']:,})"
    if ev["final"] is not None:
        line += f"; event time {ev['final']:.1f} s at the end (peak {ev['peak']:.1f} s)"
    else:
        line += "; event time: the broker gives no timestamps"
    return [line]


def shown(rep: dict[str, Any]) -> bool:
    """Whether report.png has the lag panel: the source has a lag."""
    return bool(rep.get("lag"))


def plot(ax: Any, rep: dict[str, Any], records: Sequence[StepRecord]) -> None:
    """The report.png panel of the lag: records behind (left axis) and event-time lag (right
    axis, where the records have timestamps) over the global batches read."""
    series = rep["lag"]["series"]
    batches = [p[0] for p in series]
    ax.plot(batches, [p[1] for p in series], lw=1.0, label="records behind")
    ax.set(xlabel="global batch read", ylabel="records behind the log end", title="lag")
    if any(p[2] is not None for p in series):
        twin = ax.twinx()
        twin.plot(batches, [p[2] for p in series], lw=1.0, color="tab:orange", label="event time")
        twin.set_ylabel("event-time lag (s)")
