"""The report as a list of named blocks, built in one pass over one set of inputs.

NOTE [report blocks]
~~~~~~~~~~~~~~~~~~~~
Every block of the report is a :class:`Block`: ``fields(inputs)`` gives its keys of
``report.json`` from the job's :class:`~herald.job.report.inputs.ReportInputs` (an empty
dict: not in this job's report), ``lines(rep)`` its lines of ``report.txt`` from the report
dict (so ``report.txt`` can be made again from ``report.json``), and ``plot(ax, rep,
records)``, where it has one, its panel of ``report.png``. :data:`BLOCKS` lists them in
``report.json``'s key order, :data:`TEXT_ORDER` names them in ``report.txt``'s line order
(the headline first: a signal's stop, the settings, the throughput). A block reads only the
inputs, never another block's output; what several need (this attempt's samples, the steady
span, the transmissions per cause) is a property of the inputs or a function of its module.
Adding a block touches its module and this list; the consistency block chooses the mode's
function from a registry of its own (:data:`herald.job.report.consistency.CONSISTENCY_BLOCKS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from herald.dispatch.records import StepRecord
from herald.job.report import attempts, breakdown, comm, consistency, costs, lag, run
from herald.job.report.inputs import ReportInputs


def _no_lines(rep: dict[str, Any]) -> list[str]:
    return []


def _always(rep: dict[str, Any]) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of the report (NOTE [report blocks]): ``name``, ``fields`` (inputs -> its
    report.json keys), ``lines`` (report dict -> its report.txt lines), ``plot`` (matplotlib
    axes, report dict, the step records -> its report.png panel; None: no panel),
    ``plot_width`` (the panel's relative width) and ``shown`` (report dict -> whether this
    report has the panel)."""

    name: str
    fields: Callable[[ReportInputs], dict[str, Any]]
    lines: Callable[[dict[str, Any]], list[str]] = _no_lines
    plot: Callable[[Any, dict[str, Any], Sequence[StepRecord]], None] | None = None
    plot_width: float = 1.0
    shown: Callable[[dict[str, Any]], bool] = _always


#: The report's blocks in report.json's key order (NOTE [report blocks]).
BLOCKS: tuple[Block, ...] = (
    Block("config", run.config_fields, run.config_lines),
    Block("interrupted", run.interrupted_fields, run.interrupted_lines),
    Block("skipped", run.skipped_fields, run.skipped_lines),
    Block("rejected", run.rejected_fields, run.rejected_lines),
    Block("evictions", costs.evictions_fields, costs.evictions_lines),
    Block("data", run.data_fields),
    Block("throughput", run.throughput_fields, run.throughput_lines, run.throughput_plot),
    Block("lag", lag.fields, lag.lines, lag.plot, shown=lag.shown),
    Block("metrics", run.metrics_fields, run.metrics_lines),
    Block("transmissions", comm.transmissions_fields, comm.transmissions_lines, comm.transmissions_plot),
    Block("ps_requests", comm.ps_requests_fields, comm.ps_requests_lines),
    Block("compression", comm.compression_fields, comm.compression_lines),
    Block("groups", comm.groups_fields, comm.groups_lines),
    Block("phases", breakdown.phases_fields, breakdown.phases_lines, breakdown.phases_plot, plot_width=0.7),
    Block("scheduler", costs.scheduler_fields, costs.scheduler_lines),
    Block("consistency", consistency.fields, consistency.lines),
    Block("group_streams", comm.group_streams_fields, comm.group_streams_lines),
    Block("cpu", costs.cpu_fields, costs.cpu_lines),
    Block("startup", run.startup_fields, run.startup_lines),
    Block("attempts", attempts.attempts_fields, attempts.format_lines),
    Block("replicas", run.replicas_fields),
    Block("embeddings", run.embeddings_fields, run.embeddings_lines),
    Block("failovers", attempts.failovers_fields, attempts.failover_lines),
)

#: The blocks with report.txt lines, in the text's order (NOTE [report blocks]).
TEXT_ORDER: tuple[str, ...] = (
    "interrupted",
    "config",
    "embeddings",
    "throughput",
    "lag",
    "startup",
    "consistency",
    "skipped",
    "rejected",
    "failovers",
    "attempts",
    "evictions",
    "metrics",
    "transmissions",
    "ps_requests",
    "cpu",
    "compression",
    "groups",
    "group_streams",
    "scheduler",
    "phases",
)

_BY_NAME = {b.name: b for b in BLOCKS}


def build(inp: ReportInputs) -> dict[str, Any]:
    """The report dict of ``inp``: every block's fields, in :data:`BLOCKS` order."""
    rep: dict[str, Any] = {}
    for block in BLOCKS:
        rep.update(block.fields(inp))
    return rep


def format_text(rep: dict[str, Any]) -> str:
    """report.txt of the report dict ``rep``: every block's lines, in :data:`TEXT_ORDER`."""
    return "\n".join(line for name in TEXT_ORDER for line in _BY_NAME[name].lines(rep))


def plotted(rep: dict[str, Any] | None = None) -> list[Block]:
    """The blocks with a panel in report.png, in :data:`BLOCKS` order (of the report ``rep``:
    those it shows; None: every block that can have one)."""
    return [b for b in BLOCKS if b.plot is not None and (rep is None or b.shown(rep))]
