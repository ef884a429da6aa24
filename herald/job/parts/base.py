"""The parts' interfaces, which :class:`herald.job.runner.JobRunner` calls (NOTE [job runner]
in herald/job/runner.py): :class:`PSProvider` (where the PS shards are; itself no PS: :class:`NoPS`),
:class:`WorkerLauncher` (who starts the workers; :class:`ExternalWorkers`: someone else) and
:class:`Checkpointing` (which checkpoints the dispatcher writes and resumes from). Every method
of the two bases does nothing, so a part overrides only what it does."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from herald.contracts.job import JobSpec
from herald.contracts.train import TrainConfig
from herald.dispatch.peers import Silence
from herald.errors import HeraldError
from herald.job.checkpoints import DispatcherCheckpoints
from herald.ps import PSClient


class PSProvider:
    """The PS part of a job: where its shards are. This base is no PS at all
    (:class:`NoPS`); the runner calls, in this order:

    - :meth:`prepare` before anything is read or started (checks, folders);
    - :meth:`open` once the job's data is open (its schema gives the tables): start or
      dial the shards, registering their cleanup on ``stack`` (left when the job ends);
      then :attr:`addresses` (shard order) and :attr:`client` (a :class:`PSClient`
      holding the admin token where there is one, or None) are set;
    - :meth:`check` as part of the dispatcher's liveness check (about every 0.5 s);
    - :meth:`fail` when the job failed: stop the workers and raise the job's error.

    ``cores``: with ``--pin-cores``, set before :meth:`open`: shard ``i``'s cores
    (``cores[i]``, one list per :meth:`local_processes`); None: not pinned.
    """

    cores: list[list[int]] | None = None

    def __init__(self, addresses: Sequence[str] = ()):
        self.addresses = list(addresses)
        self.client: PSClient | None = None

    def local_processes(self, cfg: TrainConfig) -> int:
        """How many processes :meth:`open` starts on this host (none here)."""
        return 0

    def prepare(self, cfg: TrainConfig) -> None:
        """Checks and folders before anything is read or started (none here)."""

    def open(self, cfg: TrainConfig, data: Any, stack: contextlib.ExitStack) -> None:
        """Start or dial the shards of ``cfg``'s tables (``data.schema``) (nothing here)."""

    def check(self) -> None:
        """Raise naming a dead or silent shard (nothing to check here)."""

    def fail(self, exc: HeraldError, workers: WorkerLauncher, silence: Silence | None = None) -> NoReturn:
        """Stop ``workers`` and raise ``exc`` (the job failed; no shard to blame here).
        ``silence``: the dispatchers' view of the wait that failed (NOTE [silent workers])."""
        workers.stop()
        raise exc


class NoPS(PSProvider):
    """No PS: workers that never dial one (the capacity bench's fake workers). The job names
    ``addresses`` (default: one that is never dialled) as its PS."""

    def __init__(self, addresses: Sequence[str] = ("tcp://127.0.0.1:1",)):
        super().__init__(addresses)


class WorkerLauncher:
    """The worker part of a job: who starts its workers. This base starts none and has
    nothing to check or stop. The runner calls, in this order:

    - :meth:`prepare` before anything is read or started;
    - :meth:`open` after the PS part (registering cleanups on ``stack``); then
      :attr:`dist_init` is the workers' ``torch.distributed`` init method for the job
      (None: ``env://``, e.g. under torchrun), and :meth:`dispatcher_bind` says where
      each dispatcher binds for these workers;
    - :meth:`start` once the dispatchers are bound: ``dispatchers[g]`` is group ``g``'s
      address (one dispatcher: a list of one); only a launcher whose
      :attr:`places_groups` is true is given one dispatcher per group (NOTE [independent
      groups]): it must tell each rank its group's dispatcher;
    - :meth:`check` in the dispatcher's liveness check; :meth:`wait` after the last step;
      :meth:`failure` and :meth:`stop` when the job failed;
    - :meth:`replicas_written` before the held-out evaluation (the report's), which reads
      every rank's ``dense-rank<r>.pt`` in the run folder.

    ``cores``: with ``--pin-cores``, set before :meth:`open`: rank ``r``'s cores
    (``cores[r]``, one list per :meth:`local_processes`); None: not pinned.
    """

    places_groups = False
    cores: list[list[int]] | None = None

    def __init__(self, dist_init: str | None = None):
        self.dist_init = dist_init

    def local_processes(self, cfg: TrainConfig) -> int:
        """How many processes :meth:`start` starts on this host (none here)."""
        return 0

    def prepare(self, cfg: TrainConfig) -> None:
        """Checks and folders before anything is read or started (none here)."""

    def open(self, cfg: TrainConfig, stack: contextlib.ExitStack) -> None:
        """What the workers need before they start (nothing here)."""

    def dispatcher_bind(self, group: int) -> str | None:
        """Where dispatcher ``group`` binds so that these workers reach it; None (here): its
        own ``bind`` setting (``herald serve dispatcher --bind``, the test bed's address)."""
        return None

    def start(self, cfg: TrainConfig, job: JobSpec, dispatchers: list[str]) -> None:
        """Start the ``cfg.workers`` workers of ``job`` against ``dispatchers`` (none here)."""

    def check(self) -> None:
        """Raise naming a worker that failed (nothing to check here)."""

    def wait(self) -> None:
        """After the dispatchers ended the job: wait for the workers to end (nothing here)."""

    def failure(self, grace_s: float = 0.0) -> str | None:
        """A message naming a worker that failed, or None."""
        return None

    def exit_codes(self) -> dict[int, int | None] | None:
        """Each worker's exit code by rank (None while it runs, negative: killed by that
        signal); None (here): the processes are not known (NOTE [silent workers])."""
        return None

    def describe(self, rank: int) -> str:
        """Rank ``rank``'s process and log, in words (a failure's headline)."""
        return "not started by this job"

    def stop(self) -> None:
        """Stop every worker still running (bounded)."""

    def replicas_written(self, cfg: TrainConfig) -> None:
        """Return once every rank's dense replica is in ``cfg.run_dir`` (already so here)."""


class ExternalWorkers(WorkerLauncher):
    """Workers started elsewhere (``herald serve worker`` on other hosts, torchrun): nothing
    is started here; :meth:`start` prints where they connect (``dispatcher listening on
    ADDRESS``, one line per dispatcher) and ``dist_init`` is what the job tells them
    (``herald serve dispatcher --dist-init``; None: ``env://``)."""

    def start(self, cfg: TrainConfig, job: JobSpec, dispatchers: list[str]) -> None:
        for address in dispatchers:
            print(f"dispatcher listening on {address}", flush=True)


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """The checkpoint part: the dispatcher resumes from ``RUN_DIR/checkpoints`` with
    ``--resume`` and, when ``enabled``, writes a checkpoint at each barrier
    (:class:`~herald.job.checkpoints.DispatcherCheckpoints`; ``who`` names the command in
    its messages). ``check_config``: write the job's hyper-parameters and consistency
    mode into every checkpoint and check them on resume (``herald train``)."""

    who: str
    enabled: bool
    check_config: bool = False

    def open(self, cfg: TrainConfig) -> DispatcherCheckpoints:
        """The job's checkpoints (finds the resume point; raises early on a bad one)."""
        return DispatcherCheckpoints(
            cfg.run_dir,
            resume=cfg.resume,
            enabled=self.enabled,
            who=self.who,
            config=cfg if self.check_config else None,
        )


def job_client(
    cfg: TrainConfig,
    addresses: Sequence[str],
    tables: Sequence[Any],
    admin_token: str | None,
    liveness: Callable[[int], None] | None = None,
) -> PSClient:
    """The job's own :class:`PSClient` of the shards at ``addresses`` (shard order) over ``tables``
    (``cfg.tables(schema)``), with the job's timeout, workers and keys, holding ``admin_token``
    (checkpoint and restore: NOTE [ps admin ops]; None: none), as every PS part opens it. Its
    waits end as soon as a shard is known dead: its death notice (NOTE [death notices] in
    herald/deaths.py) or ``liveness(shard)`` raising (e.g. a Ray actor lost)."""
    return PSClient(
        list(addresses),
        tables=tables,
        timeout_ms=cfg.timeout_ms,
        num_workers=cfg.workers,
        keys_dir=cfg.security.keys_dir,
        admin_token=admin_token,
        liveness=liveness,
    )
