"""What every consistency mode's settings share, and straggler injection (docs/consistency.md).

A mode's settings are one frozen dataclass, a :class:`ModeSettings` (each mode's own is
defined beside its entry in :mod:`herald.contracts.modes`): validated on construction,
checked against the job through one signature, :meth:`ModeSettings.check` with a
:class:`ModeContext`. Straggler injection (``--slow-worker``) is no mode's: :class:`Straggler`.

Torch-, numba- and zmq-free: :mod:`herald.contracts.train` and :mod:`herald.contracts.job` check
``herald train``'s options with it before anything starts.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

from herald.config import Nested
from herald.errors import ConfigError

#: Longest injected delay per step (``--slow-worker``), milliseconds.
MAX_SLOW_MS = 600_000


@dataclasses.dataclass(frozen=True)
class ModeContext:
    """What a mode's settings are checked against: the job around them (None: not known here).

    Attributes:
        workers: ranks of the job; global_batch: samples per global step (``workers x batch``).
        replicated: whether the job replicates tables on the workers (``--replicate-below``).
        groups: training groups (``--groups``); resume: ``--resume``;
        checkpoint_every: ``--checkpoint-every`` steps (0: none).
    """

    workers: int | None = None
    global_batch: int | None = None
    replicated: bool = False
    groups: int = 1
    resume: bool = False
    checkpoint_every: int = 0


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """The settings of one consistency mode; a subclass per mode, each field a :func:`~herald.config.setting`
    whose option (``--staleness``, ...) only that mode reads. Validated on construction.

    Attributes:
        name: the mode (``--consistency``), a class attribute of each subclass.
    """

    name: ClassVar[str] = ""

    def check(self, job: ModeContext) -> None:
        """Check the settings against the job (nothing by default).

        Raises:
            ConfigError: a combination the mode cannot run, naming the flags.
        """

    def for_job(self, job: ModeContext) -> ModeSettings:
        """The settings with their defaults resolved for ``job`` (what the workers get): themselves by default."""
        return self

    @property
    def reads_early(self) -> bool:
        """Whether the workers start the pulls marked ``pull_early`` while the step before
        computes (NOTE [early pulls] in herald/dispatch/early.py), so the dispatcher computes
        the marks. False by default: bsp's pulls ride on the step messages (NOTE [step
        messages] in herald/ps/stepped.py), hybrid pulls every row unordered, gba builds no
        plan-driven micro-batches; the micro-batches then carry no marks (all False)."""
        return False

    def micro_batch_rows(self, batch_size_per_worker: int, num_workers: int) -> int:
        """Samples in one micro-batch a worker trains: ``batch_size_per_worker`` by default."""
        return batch_size_per_worker

    def described(self) -> tuple[str, bool]:
        """What these settings do, naming their flags, and whether that is one flag (for :meth:`misplaced`)."""
        flags = [f"--{dest.replace('_', '-')}" for dest in self.flags()]
        return f"{', '.join(flags)} set --consistency {self.name}", len(flags) == 1

    def misplaced(self, mode: str) -> str:
        """The error when these settings are given to ``mode``, another mode (naming the flags)."""
        what, one = self.described()
        it, have = ("it", "it has") if one else ("them", "they have")
        return f"{what}; {have} no meaning for --consistency {mode}: drop {it} or choose {self.name}"

    def flags(self) -> dict[str, Any]:
        """The settings by option name (``{"staleness": 4}``; JSON-able)."""
        return Nested(type(self)).flatten(self)

    def to_dict(self) -> dict[str, Any]:
        """``{"name": mode, field: value, ...}`` (JSON-able; inverse:
        :func:`herald.contracts.modes.mode_from_dict`)."""
        return {"name": self.name, **dataclasses.asdict(self)}


def integer_in(value: object, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) in ``low..high``."""
    return type(value) is int and low <= value <= high


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Straggler injection for experiments (``--slow-worker RANK:MS``): worker ``rank`` sleeps
    ``ms`` milliseconds once per step (rank -1: none).

    Raises:
        ConfigError: not ints, or ``ms`` below 0.
    """

    rank: int = -1
    ms: int = 0

    def __post_init__(self) -> None:
        if not (type(self.rank) is int and type(self.ms) is int and self.ms >= 0):
            raise ConfigError(f"slow_worker_rank and slow_worker_ms must be ints, got {self.rank!r}, {self.ms!r}")

    @classmethod
    def parse(cls, text: str | None, num_workers: int | None = None) -> Straggler:
        """``--slow-worker RANK:MS``; ``None`` -> no straggler (rank -1).

        Args:
            text: ``"RANK:MS"``, RANK an int >= 0, MS an int in 1..:data:`MAX_SLOW_MS` (milliseconds
                slept by that worker once per step), or None.
            num_workers: when given, RANK must be below it.

        Raises:
            ConfigError: malformed, out of range, or RANK not a worker of the job.
        """
        if text is None:
            return cls()
        m = re.fullmatch(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*", text) if isinstance(text, str) else None
        if m is None:
            raise ConfigError(
                f"--slow-worker must be RANK:MS (e.g. 1:200: worker 1 sleeps 200 ms per step), got {text!r}"
            )
        rank, ms = int(m.group(1)), int(m.group(2))
        if not 1 <= ms <= MAX_SLOW_MS:
            raise ConfigError(f"--slow-worker MS must be in 1..{MAX_SLOW_MS} milliseconds, got {ms}")
        if num_workers is not None and rank >= num_workers:
            raise ConfigError(
                f"--slow-worker rank {rank} is not a worker of this job (--workers {num_workers}: "
                f"ranks 0..{num_workers - 1})"
            )
        return cls(rank, ms)
