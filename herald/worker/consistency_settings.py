"""Settings of the relaxed consistency modes and of straggler injection (docs/consistency.md).

Torch-, numba- and zmq-free: :mod:`herald.job.spec` imports it to check ``herald train``'s
options before anything starts.
"""

from __future__ import annotations

import re

from herald.errors import ConfigError

#: Consistency protocols a job may choose (``--consistency``): the modes built so far.
#: ``bsp``: exact (NOTE [step protocol]); ``bounded``: HET per-embedding clock-bounded
#: reads (het-vldb22 §3.3, §4.1 CheckValid; NOTE [bounded reads] in
#: herald/worker/consistency_bounded.py).
CONSISTENCY_MODES = ("bsp", "bounded")
#: Largest staleness bound ``s`` (clock ticks = updates of one embedding).
MAX_STALENESS = 1 << 20
#: Longest injected delay per step (``--slow-worker``), milliseconds.
MAX_SLOW_MS = 600_000


def parse_slow_worker(text: str | None, num_workers: int | None = None) -> tuple[int, int]:
    """``--slow-worker RANK:MS`` as ``(rank, ms)``; ``None`` -> ``(-1, 0)`` (no straggler).

    Args:
        text: ``"RANK:MS"``, RANK an int >= 0, MS an int in 1..:data:`MAX_SLOW_MS` (milliseconds
            slept by that worker once per step), or None.
        num_workers: when given, RANK must be below it.

    Raises:
        ConfigError: malformed, out of range, or RANK not a worker of the job.
    """
    if text is None:
        return -1, 0
    m = re.fullmatch(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*", text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"--slow-worker must be RANK:MS (e.g. 1:200: worker 1 sleeps 200 ms per step), "
                          f"got {text!r}")
    rank, ms = int(m.group(1)), int(m.group(2))
    if not 1 <= ms <= MAX_SLOW_MS:
        raise ConfigError(f"--slow-worker MS must be in 1..{MAX_SLOW_MS} milliseconds, got {ms}")
    if num_workers is not None and rank >= num_workers:
        raise ConfigError(f"--slow-worker rank {rank} is not a worker of this job (--workers {num_workers}: "
                          f"ranks 0..{num_workers - 1})")
    return rank, ms


def check_consistency(mode: str, staleness: int) -> None:
    """Check the consistency mode and its settings together (STYLE habit 3).

    Raises:
        ConfigError: an unknown mode, a staleness out of 0..:data:`MAX_STALENESS`, or
            ``--staleness`` given to a mode that does not read it.
    """
    if mode not in CONSISTENCY_MODES:
        raise ConfigError(f"--consistency must be one of {', '.join(CONSISTENCY_MODES)}, got {mode!r}")
    if type(staleness) is not int or not 0 <= staleness <= MAX_STALENESS:
        raise ConfigError(f"--staleness must be an integer in 0..{MAX_STALENESS}, got {staleness!r}")
    if staleness and mode != "bounded":
        raise ConfigError(f"--staleness {staleness} bounds the reads of --consistency bounded; it has no meaning "
                          f"for --consistency {mode}: drop it or choose bounded")
