"""The report part of a job (:class:`JobReport`) and the files it writes into the run folder:
``report.json``, ``report.txt`` and ``report.png``, all made from the report's blocks (NOTE
[report blocks] in herald/job/report/blocks.py)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from herald.dispatch.records import StepRecord
from herald.job.report.blocks import build, format_text, plotted
from herald.job.report.inputs import Attempt, ReportInputs


def write(rep: dict[str, Any], records: Sequence[StepRecord], run_dir: str | pathlib.Path) -> None:
    """Write ``report.json``, ``report.txt`` (also printed) and ``report.png`` (one panel per
    block that has one: the loss and the transmissions per step, where a step's time goes)
    into ``run_dir``; no figure without ``records``."""
    run_dir = pathlib.Path(run_dir)
    (run_dir / "report.json").write_text(json.dumps(rep, indent=2, default=float))
    text = format_text(rep)
    (run_dir / "report.txt").write_text(text + "\n")
    print(text)
    if not records:
        return
    # on use: matplotlib (0.5 s to import) only once there is a figure to draw
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plotted(rep)
    widths = [b.plot_width for b in panels]
    size = (round(15 * sum(widths) / 2.7, 2), 4)  # inches: 15 wide for the three panels
    fig, axes = plt.subplots(1, len(panels), figsize=size, gridspec_kw={"width_ratios": widths}, squeeze=False)
    for ax, block in zip(axes[0], panels):
        block.plot(ax, rep, records)
    fig.tight_layout()
    fig.savefig(run_dir / "report.png", dpi=110)
    plt.close(fig)
    print(f"report: {run_dir / 'report.txt'}, {run_dir / 'report.json'}, {run_dir / 'report.png'}")


class JobReport:
    """The report part of a job (NOTE [job runner] in herald/job/runner.py): after training the
    runner takes the PS shards' stats and the held-out evaluation and hands the job's
    :class:`~herald.job.report.inputs.ReportInputs` to :meth:`write`. ``failovers``: the
    report's ``failovers`` (the earlier attempts' of NOTE [ps failover]; the test bed's
    supervisor writes its own); ``earlier``: those attempts' steps and times, counted in the
    report with this one's (herald/job/report/attempts.py). Both are the failover policy's
    lists (NOTE [failover policy] in herald/job/recovery/policy.py), filled as the job goes."""

    def __init__(self, failovers: list[dict[str, Any]] | None = None, earlier: list[Attempt] | None = None):
        self.failovers = [] if failovers is None else failovers
        self.earlier = [] if earlier is None else earlier

    def write(self, inp: ReportInputs, plotted_records: Sequence[StepRecord] | None = None) -> dict[str, Any]:
        """Build the report of ``inp`` with this job's earlier attempts and failovers, write it
        into ``inp.cfg.run_dir`` (:func:`write`; the figure over ``plotted_records``, default
        ``inp.records``) and return it."""
        inp = dataclasses.replace(inp, earlier=tuple(self.earlier), failovers=tuple(self.failovers))
        rep = build(inp)
        write(rep, inp.records if plotted_records is None else plotted_records, inp.cfg.run_dir)
        return rep
