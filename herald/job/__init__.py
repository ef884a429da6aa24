"""``herald train``: the job launcher, checkpoints, progress, metrics and the report (docs/job.md)."""
