"""The pluggable parts of a job, which :class:`herald.job.runner.JobRunner` puts together
(NOTE [job runner] in herald/job/runner.py):

- a **PS provider** (:class:`PSProvider`): where the PS shards are. :class:`LocalPS`
  starts them as local processes (``herald train``); :class:`RemotePS` dials shards
  started elsewhere and watches them (``herald serve dispatcher``, the test bed); the
  base class itself (:class:`NoPS`) is no PS at all (the capacity bench's fake workers
  never dial one).
- a **worker launcher** (:class:`WorkerLauncher`): who starts the workers.
  :class:`LocalWorkers` starts them as local processes (``herald train``);
  :class:`ExternalWorkers` starts none and says where to connect (``herald serve
  dispatcher``; the test bed's torchruns: :class:`herald.testbed.dispatcher.TestBedWorkers`);
  the capacity bench's fake workers are :class:`herald.bench.capacity.AckPeerWorkers`.
  Each part says how many processes it starts on this host (``local_processes``): with
  ``--pin-cores`` the runner gives them their cores (``cores``) before it opens them.
- the **checkpoints** (:class:`Checkpointing`): which
  :class:`~herald.job.checkpoints.DispatcherCheckpoints` the dispatcher writes and resumes from.

Security (docs/operations.md, "Securing a multi-host job"): with ``--keys DIR`` every
role's ZeroMQ traffic is CURVE (NOTE [transport security] in herald/auth.py); local PS
shards take admin ops (checkpoint, restore, shutdown) only with this job's token and
only inside ``RUN_DIR/checkpoints`` (NOTE [ps admin ops]); local workers' dense process
group rendezvous through a file in the run folder (no listening store) and gloo is kept
on the loopback interface (:func:`dense_store`, :func:`worker_env`). Remote shards'
admin token comes from ``HERALD_PS_TOKEN`` in the environment, never from a command line.

Modules: :mod:`~herald.job.parts.base` (the interfaces, :class:`NoPS`, :class:`ExternalWorkers`,
:class:`Checkpointing`), :mod:`~herald.job.parts.local_ps` (:class:`LocalPS`, :func:`prepare_run`),
:mod:`~herald.job.parts.remote_ps` (:class:`RemotePS`), :mod:`~herald.job.parts.local_workers`
(:class:`LocalWorkers`, :func:`dense_store`, :func:`worker_env`; NOTE [local job sockets]).
A lost or failed process is told apart by :func:`herald.job.recovery.failure.raise_job_failure`.
"""

from herald.job.parts.base import Checkpointing, ExternalWorkers, NoPS, PSProvider, WorkerLauncher
from herald.job.parts.local_ps import LocalPS, prepare_run
from herald.job.parts.local_workers import IPC_PATH_MAX_LEN, LocalWorkers, dense_store, worker_env
from herald.job.parts.remote_ps import RemotePS
from herald.job.recovery.failure import raise_job_failure

__all__ = [
    "IPC_PATH_MAX_LEN",
    "Checkpointing",
    "ExternalWorkers",
    "LocalPS",
    "LocalWorkers",
    "NoPS",
    "PSProvider",
    "RemotePS",
    "WorkerLauncher",
    "dense_store",
    "prepare_run",
    "raise_job_failure",
    "worker_env",
]
