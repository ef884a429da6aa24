"""The end-of-job report of ``herald train`` and the test bed: progress, held-out evaluation,
``report.json``, ``report.txt`` and ``report.png``."""

from herald.job.report.consistency import (
    Progress,
    bounded_block,
    build,
    consistency_block,
    cpu_time,
    evaluate,
    final_loss,
    gba_block,
    hybrid_block,
    plan_block,
    ps_requests,
    startup_line,
    write,
)

__all__ = [
    "Progress",
    "bounded_block",
    "build",
    "consistency_block",
    "cpu_time",
    "evaluate",
    "final_loss",
    "gba_block",
    "hybrid_block",
    "plan_block",
    "ps_requests",
    "startup_line",
    "write",
]
