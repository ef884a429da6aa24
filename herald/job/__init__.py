"""``herald train``: the job runner and launcher (one dispatcher, or one per training group),
what a job reads, checkpoints, failover (a lost PS shard or worker), progress, metrics,
the report and the single-process reference (docs/job.md)."""
