"""``herald train --launcher ray``: the job's PS shards and workers as Ray actors (NOTE [ray
job] in herald/job/ray/parts.py; docs/cluster.md).

- :mod:`~herald.job.ray.parts`: the PS and worker parts (:class:`~herald.job.ray.parts.RayPS`,
  :class:`~herald.job.ray.parts.RayWorkers`) that the job runner plugs in;
- :mod:`~herald.job.ray.cluster`: the connection to Ray, the placement group and the actors;
- :mod:`~herald.job.ray.plan`: what each role asks of the cluster and is told (pure functions);
- :mod:`~herald.job.ray.role`: the actor of one role (a plain class, so Ray is imported only
  when a job starts).
"""
