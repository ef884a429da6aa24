"""What a job does when one of its processes is lost, and what a killed job leaves behind.

- :mod:`~herald.job.recovery.rollback`: ``herald train`` rolls the whole job back to its
  latest checkpoint (NOTE [ps failover] in herald/job/launcher.py, NOTE [worker failover]);
- :mod:`~herald.job.recovery.failover`: a dispatcher process that loses a PS shard exits
  with status 75 for its supervisor (NOTE [ps failover across hosts]);
- :mod:`~herald.job.recovery.silence`: which worker went silent (NOTE [silent workers]);
- :mod:`~herald.job.recovery.leftovers`: a killed job's folders, removed by the next job in
  the run folder (NOTE [run leftovers]).
"""
