"""The dense synchroniser: average the dense gradients over the ranks, then step.

Step 7 of NOTE [step protocol] (``herald/contracts/plan.py``). Every rank holds the
same dense replica (same seed, same averaged gradients), as in data-parallel training.
With ``dense_comm`` fp16/bf16 the all-reduce payload is compressed the way torch's DDP
``fp16_compress_hook`` / ``bf16_compress_hook`` do it (divide by the ranks, cast,
all-reduce, cast back; HT §4.2). With training groups (NOTE [training groups] in
herald/worker/groups.py) the all-reduce runs in the rank's group and the replicas of
the groups are averaged in the background.

:class:`DenseState` is what every dense side shares (this all-reduce, and GBA's replay of
the PS's aggregated gradients, :class:`herald.worker.consistency_gba.GbaDense`): the model,
its optimizer, and their checkpoint file ``dense.pt``.
"""

from __future__ import annotations

import abc
import json
import pathlib

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from herald.errors import ProtocolError
from herald.files import PrivateFile, private_dir
from herald.ps.config import DENSE_MAX_BYTES
from herald.worker.devices import group_for
from herald.worker.groups import GroupLayout, TrainingGroups

COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class DenseState(abc.ABC):
    """The worker's dense replica and its optimizer, as the runtime uses them (``model``,
    :meth:`step`, :meth:`save`, :meth:`load`, :meth:`close`).

    A checkpoint holds them in one file, ``folder/dense.pt``: ``{"model": state_dict,
    "optimizer": state_dict}`` (:data:`FILE`), the same under every consistency mode, so a job
    may resume under another mode (docs/consistency.md, "Switching modes").

    Args:
        model: the dense model; optimizer: its torch optimizer.

    Attributes:
        params: the parameters trained, those requiring gradients at construction (fixed
            then, as the optimizer's parameter groups are): walking ``model.parameters()``
            on each step took about 40 us a walk (DLRM, 1 thread), three walks a step.
    """

    #: the checkpoint file of the dense state, in a checkpoint folder
    FILE = "dense.pt"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]

    def start(self) -> np.ndarray | None:
        """Begin the dense step's communication when the protocol ends the step with step
        messages (``ConsistencyProtocol.step_messages``): in the background, overlapping the
        embedding updates, or by returning the gradient for the step messages to carry
        (float32 [P], NOTE [dense gradients on the shards] in herald/ps/stepped.py), which
        must hold the sum over the ranks when :meth:`step` is called with ``summed``.
        Default: nothing, None (:meth:`step` does all)."""
        return None

    @abc.abstractmethod
    def step(self, summed: bool = False) -> None:
        """The runtime's dense step after ``backward()`` (NOTE [step protocol] step 7);
        ``summed``: the step messages brought the sum of what :meth:`start` returned."""

    def save(self, folder: str | pathlib.Path) -> pathlib.Path:
        """Write model and optimizer state to ``folder/dense.pt`` (atomically; mode 0600 in a
        0700 folder: NOTE [private files] in herald/files.py); returns the path.

        Raises:
            StorageError: the file could not be written (disk full, permission denied, ...:
                the message names the file, why and the fix).
        """
        out = private_dir(folder)
        tmp = out / f"{self.FILE}.tmp"
        with PrivateFile(tmp, "checkpoint file") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, f)
        tmp.replace(out / self.FILE)
        return out / self.FILE

    def read_state(self, folder: str | pathlib.Path, device: torch.device) -> dict:
        """The state :meth:`save` wrote into ``folder``, its tensors on ``device`` (torch's errors
        for a missing or unreadable file)."""
        return torch.load(pathlib.Path(folder) / self.FILE, weights_only=True, map_location=device)

    def apply_state(self, state: dict) -> None:
        """Load a :meth:`read_state` result into the model and the optimizer."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def load(self, folder: str | pathlib.Path, device: torch.device) -> None:
        """Load the state :meth:`save` wrote into ``folder``."""
        self.apply_state(self.read_state(folder, device))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop what runs in the background, bounded by ``timeout_s`` (default: nothing runs)."""
        return None

    def background_stats(self, stats_dir: str | None = None) -> dict | None:
        """After :meth:`close`: the statistics of what ran in the background, for the report,
        or None (default: nothing runs)."""
        return None


class DenseSync(DenseState):
    """All-reduce of one flat gradient buffer, then the optimizer step.

    After the first step every ``p.grad`` is a view into one flat buffer, so
    ``backward()`` accumulates in place (grads are zeroed, not freed) and the
    all-reduce needs no concatenation or copy-back (DDP's gradient-as-bucket-view).

    Args:
        model: the dense model (the same initial parameters on every rank).
        optimizer: its optimizer.
        world_size: ranks of the default process group (1: no all-reduce).
        dense_comm: ``fp32`` (default: exactly today's all-reduce), ``fp16`` or ``bf16``.
        rank, groups, average_every, easgd_alpha: NOTE [training groups]; ``groups`` 1
            (default) is one replica, exact BSP. ``groups > 1`` is a collective setup:
            every rank constructs its DenseSync at the same point.

    The buffer lives on the parameters' device; it is all-reduced in the default group
    (NCCL or gloo), or in the gloo side group when the default group is NCCL and the
    parameters are on the CPU (:func:`herald.worker.devices.group_for`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        world_size: int,
        *,
        dense_comm: str = "fp32",
        rank: int = 0,
        groups: int = 1,
        average_every: int = 10,
        easgd_alpha: float = 0.3,
    ):
        super().__init__(model, optimizer)
        self.world_size = world_size
        self.dense_comm, self.steps = dense_comm, 0
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._work = None  # the all-reduce start() began
        self._carried = False  # start() handed the buffer to the step messages
        self.groups: TrainingGroups | None = None
        if groups > 1 and world_size > 1:
            params = self.params
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
            self.groups = TrainingGroups(
                rank, GroupLayout(world_size, groups), flat, easgd_alpha, average_every, flat.device.type
            )

    def _flat_grads(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The flat gradient buffer whose views the ``p.grad`` are (made on first use)."""
        flat = self._flat
        if flat is None or not all(
            p.grad is not None and p.grad.data_ptr() == v.data_ptr() for p, v in zip(params, self._views)
        ):
            flat = self._bucket(params)
        return flat

    def start(self) -> np.ndarray | None:
        """Hand the fp32 gradients to the step messages when they are on the CPU and at most
        :data:`~herald.ps.config.DENSE_MAX_BYTES` (NOTE [dense gradients on the shards] in
        herald/ps/stepped.py: the flat buffer itself, summed in place); else start their
        all-reduce (``async_op``: torch's work handle), which :meth:`step` waits for. Either
        sum is what :meth:`step` would compute, the same on every rank, so the replicas stay
        bit-identical; with training groups or a compressed payload :meth:`step` runs the
        all-reduce as before."""
        params = self.params
        if self.world_size > 1 and params and self.groups is None and self.dense_comm == "fp32":
            flat = self._flat_grads(params)
            if flat.device.type == "cpu" and flat.numel() * flat.element_size() <= DENSE_MAX_BYTES:
                self._carried = True
                return flat.numpy()
            self._work = dist.all_reduce(flat, group=group_for(flat), async_op=True)  # NOTE [worker devices]
        return None

    def step(self, summed: bool = False) -> None:
        """Average the gradients over the ranks (one all-reduce, the one :meth:`start` began,
        or the step messages' sum: ``summed``), step, zero the gradients.

        Raises:
            ProtocolError: :meth:`start` handed the gradients to the step messages and they
                did not bring the sum back (a runtime bug: the replicas would diverge).
        """
        params = self.params
        self.steps += 1
        raised = False
        carried, self._carried = self._carried, False
        if carried != summed:
            raise ProtocolError(
                "the dense gradients were handed to the step messages but no sum came back"
                if carried
                else "a dense sum came back for gradients never handed out"
            )
        if carried:
            self._flat /= self.world_size
        elif self._work is not None:
            work, self._work = self._work, None
            work.wait()
            self._flat /= self.world_size
        elif self.world_size > 1 and params:
            flat = self._flat_grads(params)
            if self.groups is not None:
                flat[-1] = self.groups.flag()  # NOTE [training groups], step 3
                self._all_reduce(flat, self.groups.process_group, self.groups.layout.size)
                raised = bool(flat[-1] > 0)
            elif self.dense_comm != "fp32":
                self._all_reduce(flat, group_for(flat), self.world_size)
            else:
                dist.all_reduce(flat, group=group_for(flat))  # NOTE [worker devices]
                flat /= self.world_size
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        if self.groups is not None and params:
            self.groups.apply(params, self.steps, raised)

    def _all_reduce(self, flat: torch.Tensor, group, ranks: int) -> None:
        """Average ``flat`` over ``ranks`` ranks of ``group``, in the ``dense_comm`` payload dtype."""
        if ranks == 1:
            return
        if self.dense_comm == "fp32":
            dist.all_reduce(flat, group=group)
            flat /= ranks
            return
        compressed = flat.to(COMM_DTYPES[self.dense_comm]).div_(ranks)  # as DDP's fp16_compress_hook
        dist.all_reduce(compressed, group=group)
        flat.copy_(compressed)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the group's averaging thread, bounded by ``timeout_s`` (nothing without
        groups). Idempotent."""
        if self.groups is not None:
            self.groups.close(timeout_s)

    def background_stats(self, stats_dir: str | None = None) -> dict | None:
        """After :meth:`close` (the queued and drain rounds count): the averaging's statistics
        with ``thread_ended`` (also written to ``stats_dir/groups-rank<r>.json`` for the
        report), or None without groups."""
        if self.groups is None:
            return None
        stats = dict(self.groups.stats(), thread_ended=self.groups.ended)
        if stats_dir:
            out = pathlib.Path(stats_dir) / f"groups-rank{self.groups.rank}.json"
            out.with_suffix(".tmp").write_text(json.dumps(stats))
            out.with_suffix(".tmp").replace(out)
        return stats

    def _bucket(self, params: list[torch.Tensor]) -> torch.Tensor:
        extra = [torch.zeros(1, dtype=params[0].dtype, device=params[0].device)] if self.groups is not None else []
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params] + extra)
        self._flat, self._views = flat, []
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            self._views.append(p.grad)
            offset += n
        return flat

    def load(self, folder: str | pathlib.Path, device: torch.device) -> None:
        """Load the state :meth:`save` wrote into ``folder``."""
        super().load(folder, device)
        if self.groups is not None and self.groups.averager is not None:  # the center restarts from the replica
            self.groups.averager.center = torch.cat(
                [p.detach().reshape(-1).cpu() for p in self.model.parameters() if p.requires_grad]
            )
