"""The worker's dense process group: its torch.distributed position, device and backend,
joining it and leaving it (NOTE [worker devices] in herald/worker/devices.py).

:class:`DenseGroup` is what :meth:`herald.worker.api.ScheduledLoader.connect` joins once the
job is known, and what its ``close()`` leaves: the group it created is destroyed then, one
that the training script created stays the script's.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

from herald.contracts.job import JobSpec
from herald.errors import ConfigError
from herald.worker.devices import DeviceChoice, select_device, setup_collectives
from herald.worker.groups import world_position


class DenseGroup:
    """Dispatcher rank ``rank`` of ``world_size``'s place in the dense process group.

    Picks the device (``torch.cuda.set_device`` included: before the group is created);
    :meth:`join` then creates or joins the group.

    Args:
        job: the :class:`JobSpec` (its groups: NOTE [independent groups] in
            herald/job/group_dispatch.py; its ``dist_init``).
        rank, world_size: this worker among the dispatcher's workers.
        device: the requested device (``auto``, ``cpu``, ``cuda``, ``cuda:N``: NOTE [worker devices]).

    Attributes:
        rank, world_size: torch.distributed's rank and world (they differ from the
            dispatcher's with one dispatcher per group); choice: the
            :class:`~herald.worker.devices.DeviceChoice` (device, backend, notice);
            owned: whether :meth:`join` created the process group.

    Raises:
        ConfigError: a device that cannot be had, or a job of another group layout.
    """

    def __init__(self, job: JobSpec, rank: int, world_size: int, device: str | None):
        self.job = job
        self.rank, self.world_size = world_position(job.group_index, job.groups.count, rank, world_size)
        self.choice: DeviceChoice = select_device(self.rank, self.world_size, device)
        self.owned = False

    def join(self, dist_init: str | None, timeout_ms: int) -> None:
        """Join the group when there is one (world size > 1): create it unless the training
        script did (the method: ``dist_init``, else ``env://`` under torchrun, else the job's;
        every collective bounded by ``timeout_ms``), then the gloo side group for CPU
        tensors when the group is NCCL.

        Raises:
            ConfigError: no init method at all.
        """
        if self.world_size <= 1:
            return
        if not dist.is_initialized():
            method = dist_init or ("env://" if "MASTER_ADDR" in os.environ else self.job.dist_init)
            if not method:
                raise ConfigError(
                    "no torch.distributed init method: pass dist_init, run under torchrun, or set dist_init in the job"
                )
            if self.choice.notice and self.rank == 0:
                print(f"herald worker: {self.choice.notice}", file=sys.stderr, flush=True)
            dist.init_process_group(
                self.choice.backend,
                init_method=method,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(milliseconds=timeout_ms),
            )
            self.owned = True
        setup_collectives()

    def leave(self, threads_ended: bool = True) -> None:
        """Destroy the group :meth:`join` created (idempotent). A process group left to the
        interpreter's exit can abort it (gloo: "terminate called without an active
        exception", signal 6). Not while a thread may still be inside a collective
        (``threads_ended`` False: the averaging thread of NOTE [training groups] did not end
        in time): it is a daemon and ends with the process."""
        if self.owned and dist.is_initialized() and threads_ended:
            dist.destroy_process_group()
        self.owned = False
