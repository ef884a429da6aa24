"""Hierarchical training groups with background EASGD averaging (HT §3.1, ShadowSync).

NOTE [training groups] (docs/compression.md, "Training groups"). ``--groups G`` splits
the ``world_size`` ranks into G equal groups of consecutive ranks (group ``g`` holds ranks
``g*k .. g*k + k - 1``, ``k = world_size / G``; its *leader* is rank ``g*k``). Each
group is one dense replica: its ranks all-reduce their dense gradients every step in the
group's own process group (``dist.new_group``), so the ranks of a group stay equal.
Across groups the replicas are averaged in the background with EASGD (Zhang et al.
2015; HT §3.1 "background averaging ... using ShadowSync with the EASGD algorithm"):

1. every ``average_every`` steps the leader copies its replica ``x_g`` (the *read*, at
   step ``s``) and hands it to its averaging thread; the training step does not wait;
2. the thread computes ``d_g = x_g - c`` against its copy of the global (center) model
   ``c``, all-reduces ``D = sum_g d_g`` in the leaders' process group, and sets
   ``c <- c + alpha * D`` (the center moves towards every replica) and the group's
   elastic correction ``delta_g <- delta_g + alpha * d_g``;
3. at the next step after the round finished, the leader raises a flag inside the
   group's gradient all-reduce (one extra element), broadcasts ``delta_g`` in the group,
   and every rank of the group applies ``x <- x - delta_g`` after its optimizer step
   (the *write*, at step ``t``). ``t - s`` is the averaging *lag*, measured and reported.

The dense-parameter store is a torch.distributed (gloo) group of the group leaders, each
holding the same center copy (every round applies the same ``D`` to it), rather than a
PS shard holding dense tensors. Trade-off: no new PS op and no extra process, and the
center never sits on one host's network link (an all-reduce, not G pulls and pushes to
one shard); but a round is a collective of all leaders, so a slow group's leader delays
the *averaging* (never the training) of the others: the lag shows it. A PS store would
let each group average on its own clock (true asynchrony) at the price of a shard that
every leader reads and writes.

Rounds stay matched across leaders: a round that finds the thread still busy is queued,
and queued rounds use the newest copy (memory stays one replica), so each leader runs one
round per submission. Groups may train different numbers of steps (NOTE [independent
groups] in herald/job/group_dispatch.py: each group has its own dispatcher and data), so
every round also all-reduces a *finished* count (one extra element), and a leader whose
group stopped training keeps running rounds with its final replica (the *drain*) until
the count says every leader finished: all leaders then stop after the same round, and
no collective is left waiting for a leader that is gone. A thread that fails is reported,
by group and ranks, at the next step
(:class:`GroupAveragingFailed`); it never dies silently. G = 1 creates nothing: the
dense all-reduce is today's exact BSP.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from herald.errors import ConfigError, HeraldError


class GroupAveragingFailed(HeraldError):
    """A group's background averaging thread raised; the message names the group and its ranks."""


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """``groups`` equal groups of consecutive ranks among ``world_size`` (NOTE [training groups]).

    Raises:
        ConfigError: ``groups`` < 1 or not dividing ``world_size``.
    """

    world_size: int
    groups: int

    def __post_init__(self) -> None:
        if self.groups < 1 or self.world_size < 1 or self.world_size % self.groups:
            raise ConfigError(f"--groups {self.groups} must divide the {self.world_size} workers (equal groups)")

    @property
    def size(self) -> int:
        """Ranks per group."""
        return self.world_size // self.groups

    def group_of(self, rank: int) -> int:
        return rank // self.size

    def ranks(self, group: int) -> list[int]:
        return list(range(group * self.size, (group + 1) * self.size))

    def leaders(self) -> list[int]:
        return [g * self.size for g in range(self.groups)]

    def describe(self, group: int) -> str:
        r = self.ranks(group)
        return f"group {group} (ranks {r[0]}-{r[-1]})" if len(r) > 1 else f"group {group} (rank {r[0]})"


def world_position(group_index: int, groups: int, rank: int, world_size: int) -> tuple[int, int]:
    """The torch.distributed ``(rank, world size)`` of dispatcher rank ``rank`` of
    ``world_size``: unchanged with one dispatcher (``group_index`` -1); with one dispatcher
    per group (NOTE [independent groups] in herald/job/group_dispatch.py) group ``g``'s
    rank ``r`` is ``g * world_size + r`` of ``groups * world_size``.

    Raises:
        ConfigError: ``group_index`` not in -1..groups-1 or ``rank`` not below ``world_size``.
    """
    if not -1 <= group_index < groups or not 0 <= rank < world_size:
        raise ConfigError(
            f"group {group_index} of {groups}, rank {rank} of {world_size}: the dispatcher sent a "
            "job of another layout; restart the worker with its group's dispatcher address"
        )
    if group_index < 0:
        return rank, world_size
    return group_index * world_size + rank, groups * world_size


def easgd_round_flagged(
    replica: torch.Tensor, center: torch.Tensor, alpha: float, reduce: Callable[[torch.Tensor], None], finished: bool
) -> tuple[torch.Tensor, int]:
    """:func:`easgd_round` whose all-reduce also sums the leaders' *finished* flags (one
    extra element, NOTE [training groups] "drain"). Returns ``(alpha * d, leaders finished)``."""
    diff = replica - center
    total = torch.cat([diff, diff.new_tensor([1.0 if finished else 0.0])])
    reduce(total)
    center.add_(total[: diff.numel()], alpha=alpha)
    return diff.mul_(alpha), round(float(total[-1]))


def easgd_round(
    replica: torch.Tensor, center: torch.Tensor, alpha: float, reduce: Callable[[torch.Tensor], None]
) -> torch.Tensor:
    """One EASGD round of one group (NOTE [training groups], step 2): ``reduce`` sums
    ``d = replica - center`` over the groups in place; ``center`` moves to
    ``center + alpha * sum d`` (in place). Returns the group's correction ``alpha * d``.

    Args:
        replica, center: float32 [n], the group's replica copy and its center copy.
        alpha: elastic moving rate in (0, 1).
    """
    diff = replica - center
    total = diff.clone()
    reduce(total)
    center.add_(total, alpha=alpha)
    return diff.mul_(alpha)


class GroupAverager:
    """A leader's background averaging thread (NOTE [training groups], steps 1-2).

    Args:
        layout, group: the groups and this leader's group index.
        center: float32 [n] CPU tensor, the initial global model (the initial replica).
        alpha: EASGD moving rate; reduce: in-place sum over the leaders (default: an
            all-reduce in ``leaders_group``), injectable for tests.
        drain: every round carries the finished flag and :meth:`close` drains (NOTE
            [training groups]); every leader must use the same setting.
    """

    def __init__(
        self,
        layout: GroupLayout,
        group: int,
        center: torch.Tensor,
        alpha: float,
        reduce: Callable[[torch.Tensor], None],
        drain: bool = False,
    ):
        self.layout, self.group, self.alpha, self._reduce = layout, group, float(alpha), reduce
        self._drain, self.drain_rounds = bool(drain), 0
        self.center = center.detach().to("cpu", torch.float32).clone()
        self._cond = threading.Condition()
        self._rounds_due = 0  # rounds submitted and not yet run
        self._latest: tuple[int, torch.Tensor] | None = None
        self._delta: torch.Tensor | None = None
        self._delta_read_step = -1  # oldest read step whose correction is pending
        self._error: BaseException | None = None
        self._stop = False
        self.rounds = self.coalesced = 0
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name=f"herald-easgd-{layout.describe(group)}", daemon=True)
        self._thread.start()

    def submit(self, step: int, replica: torch.Tensor) -> None:
        """Queue one round on a copy of ``replica`` read at ``step``; never blocks on the round."""
        self.check()
        with self._cond:
            if self._rounds_due and self._latest is not None:
                self.coalesced += 1  # the queued round will use this newer copy
            self._latest = (step, replica.detach().to("cpu", torch.float32, copy=True))
            self._rounds_due += 1
            self._cond.notify()

    def has_correction(self) -> bool:
        """Whether a finished round's correction waits to be applied."""
        self.check()
        with self._cond:
            return self._delta is not None

    def take_correction(self) -> tuple[torch.Tensor | None, int]:
        """``(delta, read step)`` of the finished rounds since the last call, or ``(None, -1)``."""
        self.check()
        with self._cond:
            delta, read = self._delta, self._delta_read_step
            self._delta, self._delta_read_step = None, -1
        return delta, read

    def check(self) -> None:
        """Raises:
        GroupAveragingFailed: the thread died (names the group, its ranks and the cause)."""
        if self._error is not None:
            raise GroupAveragingFailed(
                f"{self.layout.describe(self.group)}: its background EASGD averaging thread died: "
                f"{type(self._error).__name__}: {self._error}. The leaders' group (gloo) is broken or a leader "
                "left; restart the job (--resume continues from the last checkpoint)"
            ) from self._error

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._rounds_due and not self._stop:
                        self._cond.wait()
                    if not self._rounds_due:
                        break
                    step, replica = self._latest
                    self._rounds_due -= 1
                t0 = time.perf_counter()
                if self._drain:
                    delta, _ = easgd_round_flagged(replica, self.center, self.alpha, self._reduce, False)
                else:
                    delta = easgd_round(replica, self.center, self.alpha, self._reduce)
                self.busy_s += time.perf_counter() - t0
                with self._cond:
                    self._delta = delta if self._delta is None else self._delta.add_(delta)
                    if self._delta_read_step < 0:
                        self._delta_read_step = step
                    self.rounds += 1
                    self._cond.notify_all()
            if self._drain:
                self._drain_until_all_finished()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by check()
            self._error = exc

    def _drain_until_all_finished(self) -> None:
        """Rounds with the final replica and the finished flag until every leader finished
        (each round is one collective; a leader that is gone ends it with the group's timeout)."""
        replica = self._latest[1] if self._latest is not None else self.center.clone()
        while True:
            _, finished = easgd_round_flagged(replica, self.center, self.alpha, self._reduce, True)
            self.drain_rounds += 1
            if finished >= self.layout.groups:
                return

    def close(self, timeout_s: float = 30.0) -> None:
        """Run the queued rounds (and with ``drain`` the drain, until every leader finished),
        bounded by ``timeout_s``, then stop; :attr:`ended` then says whether the thread ended
        in time (False: a leader's round is stuck; the thread is a daemon). Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    @property
    def ended(self) -> bool:
        """Whether the averaging thread has ended (after :meth:`close`: in time)."""
        return not self._thread.is_alive()


class TrainingGroups:
    """This rank's part of NOTE [training groups]: the group's process group, and on the
    leader the :class:`GroupAverager`. A collective constructor: every rank calls it with
    the same arguments, after ``init_process_group``.

    Args:
        rank, layout: this rank and the groups.
        params: float32 [n] flat copy of the initial dense parameters (the first center).
        alpha, average_every: EASGD moving rate and steps between rounds.
        device_type: ``cpu`` or ``cuda``: where the dense gradients live (the intra-group
            group then uses gloo, or the default backend).
    """

    def __init__(
        self,
        rank: int,
        layout: GroupLayout,
        params: torch.Tensor,
        alpha: float,
        average_every: int,
        device_type: str = "cpu",
    ):
        self.rank, self.layout, self.average_every = rank, layout, int(average_every)
        self.group_index = layout.group_of(rank)
        backend = "gloo" if device_type == "cpu" else None
        made = [dist.new_group(layout.ranks(g), backend=backend) for g in range(layout.groups)]
        self.process_group = made[self.group_index]
        leaders = dist.new_group(layout.leaders(), backend="gloo")
        self.leader = layout.leaders()[self.group_index]
        self.averager = (
            GroupAverager(
                layout, self.group_index, params, alpha, lambda t: dist.all_reduce(t, group=leaders), drain=True
            )
            if rank == self.leader
            else None
        )
        self.lags: list[int] = []

    def flag(self) -> float:
        """1.0 on a leader holding a finished correction (raised in the gradient all-reduce), else 0.0."""
        return 1.0 if self.averager is not None and self.averager.has_correction() else 0.0

    def apply(self, params: list[torch.Tensor], step: int, raised: bool) -> None:
        """After the optimizer step: if the flag was raised, broadcast the leader's
        correction in the group and subtract it from every parameter (the write); then,
        every ``average_every`` steps, the leader hands a copy of its replica to its thread."""
        if raised:
            n = sum(p.numel() for p in params)
            if self.averager is not None:
                delta, read = self.averager.take_correction()
                delta = delta.to(params[0].device)
                self.lags.append(step - read)
            else:
                delta = torch.empty(n, dtype=torch.float32, device=params[0].device)
            if self.layout.size > 1:
                dist.broadcast(delta, src=self.leader, group=self.process_group)
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.sub_(delta[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        if self.averager is not None and step % self.average_every == 0:
            self.averager.submit(step, torch.cat([p.detach().reshape(-1) for p in params]))

    def stats(self) -> dict:
        """Averaging statistics of this rank (the leader's are the group's): rounds, lag in steps."""
        lags = np.array(self.lags or [0])
        a = self.averager
        return {
            "group": self.group_index,
            "ranks": self.layout.ranks(self.group_index),
            "leader": self.leader,
            "rounds": a.rounds if a else 0,
            "coalesced": a.coalesced if a else 0,
            "drain_rounds": a.drain_rounds if a else 0,
            "averaging_busy_s": round(a.busy_s, 6) if a else 0.0,
            "corrections": len(self.lags),
            "lag_steps_mean": float(lags.mean()),
            "lag_steps_max": int(lags.max()),
        }

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the averaging thread, bounded by ``timeout_s`` (:attr:`ended`: in time)."""
        if self.averager is not None:
            self.averager.close(timeout_s)

    @property
    def ended(self) -> bool:
        """Whether this rank's averaging thread has ended (True without one)."""
        return self.averager is None or self.averager.ended
