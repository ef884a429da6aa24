"""Settings of wire compression and of hierarchical training groups (docs/compression.md):
:class:`CommSettings` and :class:`GroupSettings`, nested once in
:class:`~herald.contracts.train.TrainConfig` and :class:`~herald.contracts.job.JobSpec`.

Torch-, numba- and zmq-free: :mod:`herald.contracts.train` and :mod:`herald.contracts.job` check
``herald train``'s options with it before anything starts.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from herald.config import setting
from herald.contracts.vocab import DENSE_COMM_DTYPES, WIRE_DTYPES
from herald.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class CommSettings:
    """Compression of the job's traffic (NOTE [wire compression] in herald/ps/compress.py;
    Persia §4.2.3, HT §4.2).

    Attributes:
        wire_dtype: embedding rows and gradients between workers and the PS, one of :data:`WIRE_DTYPES`.
        dense_comm: the dense all-reduce's payload, one of :data:`DENSE_COMM_DTYPES`.

    Raises:
        ConfigError: an unknown dtype, naming the flag.
    """

    wire_dtype: str = setting(
        "fp32",
        "embedding rows and gradients on the PS wire (the PS keeps fp32; docs/compression.md)",
        choices=WIRE_DTYPES,
    )
    dense_comm: str = setting("fp32", "dense all-reduce payload (DDP compress hooks)", choices=DENSE_COMM_DTYPES)

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if self.dense_comm not in DENSE_COMM_DTYPES:
            raise ConfigError(f"--dense-comm must be one of {', '.join(DENSE_COMM_DTYPES)}, got {self.dense_comm!r}")


@dataclasses.dataclass(frozen=True)
class GroupSettings:
    """Hierarchical training's groups (HT §3.1; NOTE [training groups] in herald/worker/groups.py).

    Attributes:
        count: G >= 1 groups of ranks (``--groups``).
        average_every: steps between two background averagings of a group (>= 1).
        easgd_alpha: EASGD's elastic moving rate, in (0, 1) (HT §3.1, Zhang et al. 2015); a float.

    Raises:
        ConfigError: a value out of range, naming the flag.
    """

    count: int = setting(
        1,
        "Hierarchical Training's dense half: G dense replicas, each all-reduced within its "
        "group and averaged between groups in the background by EASGD (1: one replica); "
        "with --consistency hybrid each group has its own dispatcher and share of the data, "
        "with bsp and bounded the groups stay in lockstep under one dispatcher, not with gba",
        metavar="G",
        dest="groups",
    )
    average_every: int = setting(10, "steps between a group's EASGD averagings", metavar="STEPS")
    easgd_alpha: float = setting(0.3, "--groups > 1: EASGD elastic moving rate in (0, 1)", metavar="ALPHA")

    def __post_init__(self) -> None:
        if type(self.count) is not int or self.count < 1:
            raise ConfigError(f"--groups must be an int >= 1, got {self.count!r}")
        if type(self.average_every) is not int or self.average_every < 1:
            raise ConfigError(f"--average-every must be an int >= 1 (steps), got {self.average_every!r}")
        alpha = self.easgd_alpha
        if (
            not isinstance(alpha, numbers.Real)
            or isinstance(alpha, bool)
            or not math.isfinite(alpha)
            or not 0 < alpha < 1
        ):
            raise ConfigError(f"--easgd-alpha must be a number in (0, 1), got {alpha!r}")
        object.__setattr__(self, "easgd_alpha", float(alpha))  # frozen: normalised once, on construction

    def check(self, workers: int) -> None:
        """The groups divide the job's ``workers`` ranks (equal groups).

        Raises:
            ConfigError: they do not.
        """
        if workers % self.count:
            raise ConfigError(f"--groups {self.count} must divide --workers {workers} (equal groups of ranks)")


def check_comm(
    wire_dtype: str, dense_comm: str, groups: int, average_every: int, easgd_alpha: float, workers: int | None = None
) -> None:
    """Check the compression and group settings together, naming the flags: :class:`CommSettings`
    and :class:`GroupSettings` (dividing ``workers`` when given).

    Raises:
        ConfigError: a value out of range or ``groups`` not dividing ``workers``.
    """
    CommSettings(wire_dtype, dense_comm)
    settings = GroupSettings(groups, average_every, easgd_alpha)
    if workers is not None:
        settings.check(workers)
