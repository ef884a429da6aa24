"""``herald train``: the job runner and launcher (one dispatcher, or one per training group),
what a job reads, checkpoints, PS failover, progress, metrics, the report and the
single-process reference (docs/job.md)."""
