"""The end-of-job report of ``herald train`` and the test bed, and what ``herald train`` shows
while it trains.

- :mod:`~herald.job.report.blocks`: the report as named blocks built in one pass (NOTE
  [report blocks]); the blocks live by topic in :mod:`~herald.job.report.run` (settings,
  throughput, metrics), :mod:`~herald.job.report.comm` (transmissions, compression, groups),
  :mod:`~herald.job.report.consistency` (each mode's block: ``CONSISTENCY_BLOCKS``),
  :mod:`~herald.job.report.costs` (CPU, scheduling, evictions),
  :mod:`~herald.job.report.breakdown` (where the time went) and
  :mod:`~herald.job.report.attempts` (failovers);
- :mod:`~herald.job.report.inputs`: what every block reads (:class:`ReportInputs`);
- :mod:`~herald.job.report.files`: the report part (:class:`JobReport`) and report.json,
  report.txt, report.png;
- :mod:`~herald.job.report.evaluate`: the held-out evaluation; :mod:`~herald.job.report.metrics`:
  AUC and log loss; :mod:`~herald.job.report.progress`: the progress bar and progressive validation.
"""

from herald.job.report.blocks import BLOCKS, TEXT_ORDER, Block, build, format_text
from herald.job.report.comm import ps_requests
from herald.job.report.consistency import (
    CONSISTENCY_BLOCKS,
    bounded_block,
    consistency_block,
    gba_block,
    hybrid_block,
    plan_block,
)
from herald.job.report.costs import cpu_time
from herald.job.report.evaluate import evaluate, evictions
from herald.job.report.files import JobReport, write
from herald.job.report.inputs import Attempt, CpuTime, GroupStreams, ReportInputs
from herald.job.report.progress import Progress, progressive
from herald.job.report.run import final_loss, startup_line

__all__ = [
    "BLOCKS",
    "CONSISTENCY_BLOCKS",
    "TEXT_ORDER",
    "Attempt",
    "Block",
    "CpuTime",
    "GroupStreams",
    "JobReport",
    "Progress",
    "ReportInputs",
    "bounded_block",
    "build",
    "consistency_block",
    "cpu_time",
    "evaluate",
    "evictions",
    "final_loss",
    "format_text",
    "gba_block",
    "hybrid_block",
    "plan_block",
    "progressive",
    "ps_requests",
    "startup_line",
    "write",
]
