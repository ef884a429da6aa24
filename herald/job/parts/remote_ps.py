"""PS shards started elsewhere (``herald serve dispatcher --ps``, the test bed): :class:`RemotePS`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, NoReturn

from herald.contracts.train import TrainConfig
from herald.dispatch.peers import Silence
from herald.errors import HeraldError
from herald.job.parts.base import PSProvider, WorkerLauncher, job_client
from herald.job.recovery.failover import shard_lost, watch_shards


class RemotePS(PSProvider):
    """PS shards started elsewhere, at ``addresses`` (``herald serve dispatcher --ps``, the
    test bed): dialled with the admin token of ``HERALD_PS_TOKEN`` (if set, for checkpoint
    and restore), every shard pinged before the job starts (bounded by ``--timeout-ms``) and
    watched during it (:func:`herald.job.recovery.failover.watch_shards`). A lost shard ends the job
    with :class:`~herald.job.recovery.failover.ShardLost` (exit status 75, NOTE [ps failover across
    hosts]) naming the latest checkpoint of ``run_dir`` (None: the job writes none).
    """

    def __init__(self, addresses: Sequence[str], *, run_dir: str | None = None):
        super().__init__(addresses)
        self.run_dir = run_dir

    def open(self, cfg: TrainConfig, data: Any, stack: contextlib.ExitStack) -> None:
        self.watch = watch_shards(self.addresses, cfg.timeout_ms, cfg.security.keys_dir)  # NOTE [ps liveness]
        stack.callback(self.watch.close)
        token = os.environ.get("HERALD_PS_TOKEN")
        self.client = stack.enter_context(job_client(cfg, self.addresses, cfg.tables(data.schema), token))
        self.client.ping()  # every shard up (bounded by --timeout-ms) before the watch starts its clock

    def check(self) -> None:
        self.watch()

    def fail(self, exc: HeraldError, workers: WorkerLauncher, silence: Silence | None = None) -> NoReturn:
        """``exc`` as it was, or :func:`~herald.job.recovery.failover.shard_lost` when the watch saw a
        shard go silent (the symptom replaced by its cause)."""
        workers.stop()
        if self.watch.failure() is None:
            raise exc
        raise shard_lost(self.watch.failure(), self.run_dir) from exc
