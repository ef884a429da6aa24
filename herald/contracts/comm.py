"""Settings of wire compression and of hierarchical training groups (docs/compression.md).

Torch-, numba- and zmq-free: :mod:`herald.contracts.train` and :mod:`herald.contracts.job` check
``herald train``'s options with it before anything starts.
"""

from __future__ import annotations

import math
import numbers

from herald.contracts.vocab import DENSE_COMM_DTYPES, WIRE_DTYPES
from herald.errors import ConfigError


def check_comm(
    wire_dtype: str, dense_comm: str, groups: int, average_every: int, easgd_alpha: float, workers: int | None = None
) -> None:
    """Check the compression and group settings together, naming the flags.

    Args:
        wire_dtype: one of :data:`WIRE_DTYPES`; dense_comm: one of :data:`DENSE_COMM_DTYPES`.
        groups: G >= 1 groups of ranks (HT §3.1), dividing ``workers`` when given.
        average_every: steps between two background averagings of a group (>= 1).
        easgd_alpha: EASGD's elastic moving rate, in (0, 1) (HT §3.1, Zhang et al. 2015).

    Raises:
        ConfigError: a value out of range or ``groups`` not dividing ``workers``.
    """
    if wire_dtype not in WIRE_DTYPES:
        raise ConfigError(f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
    if dense_comm not in DENSE_COMM_DTYPES:
        raise ConfigError(f"--dense-comm must be one of {', '.join(DENSE_COMM_DTYPES)}, got {dense_comm!r}")
    if type(groups) is not int or groups < 1:
        raise ConfigError(f"--groups must be an int >= 1, got {groups!r}")
    if workers is not None and workers % groups:
        raise ConfigError(f"--groups {groups} must divide --workers {workers} (equal groups of ranks)")
    if type(average_every) is not int or average_every < 1:
        raise ConfigError(f"--average-every must be an int >= 1 (steps), got {average_every!r}")
    if (
        not isinstance(easgd_alpha, numbers.Real)
        or isinstance(easgd_alpha, bool)
        or not math.isfinite(easgd_alpha)
        or not 0 < easgd_alpha < 1
    ):
        raise ConfigError(f"--easgd-alpha must be a number in (0, 1), got {easgd_alpha!r}")
