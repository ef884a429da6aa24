"""Settings of the relaxed consistency modes and of straggler injection (docs/consistency.md).

Torch-, numba- and zmq-free: :mod:`herald.contracts.train` and :mod:`herald.contracts.job` check
``herald train``'s options with it before anything starts.
"""

from __future__ import annotations

import re

from herald.contracts.vocab import CONSISTENCY_MODES
from herald.errors import ConfigError

#: Largest staleness bound ``s`` (clock ticks = updates of one embedding).
MAX_STALENESS = 1 << 20
#: Largest ``--hybrid-expiry`` (steps a buffered sample waits for its gradient).
MAX_HYBRID_EXPIRY = 1 << 20
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
        raise ConfigError(f"--slow-worker must be RANK:MS (e.g. 1:200: worker 1 sleeps 200 ms per step), got {text!r}")
    rank, ms = int(m.group(1)), int(m.group(2))
    if not 1 <= ms <= MAX_SLOW_MS:
        raise ConfigError(f"--slow-worker MS must be in 1..{MAX_SLOW_MS} milliseconds, got {ms}")
    if num_workers is not None and rank >= num_workers:
        raise ConfigError(
            f"--slow-worker rank {rank} is not a worker of this job (--workers {num_workers}: "
            f"ranks 0..{num_workers - 1})"
        )
    return rank, ms


def check_consistency(mode: str, staleness: int) -> None:
    """Check the consistency mode and its settings together naming the flags.

    Raises:
        ConfigError: an unknown mode, a staleness out of 0..:data:`MAX_STALENESS`, or
            ``--staleness`` given to a mode that does not read it.
    """
    if mode not in CONSISTENCY_MODES:
        raise ConfigError(f"--consistency must be one of {', '.join(CONSISTENCY_MODES)}, got {mode!r}")
    if type(staleness) is not int or not 0 <= staleness <= MAX_STALENESS:
        raise ConfigError(f"--staleness must be an integer in 0..{MAX_STALENESS}, got {staleness!r}")
    if staleness and mode != "bounded":
        raise ConfigError(
            f"--staleness {staleness} bounds the reads of --consistency bounded; it has no meaning "
            f"for --consistency {mode}: drop it or choose bounded"
        )


def check_hybrid(mode: str, expiry_steps: int | None, replicated: bool) -> None:
    """Check ``--hybrid-expiry`` against the mode (NOTE [hybrid training] in herald/dispatch/hybrid.py).

    Args:
        mode: the consistency mode.
        expiry_steps: steps a sample's ID features wait in the dispatcher's buffer for their
            gradient before they are dropped (counted); None: never (the credit window bounds it).
        replicated: whether the job replicates tables on the workers (``--replicate-below``).

    Raises:
        ConfigError: an expiry out of 0..:data:`MAX_HYBRID_EXPIRY`, an expiry given to another
            mode, or replicated tables under hybrid (its workers hold no embedding rows).
    """
    if expiry_steps is not None and (type(expiry_steps) is not int or not 0 <= expiry_steps <= MAX_HYBRID_EXPIRY):
        raise ConfigError(f"--hybrid-expiry must be an integer in 0..{MAX_HYBRID_EXPIRY} steps, got {expiry_steps!r}")
    if expiry_steps is not None and mode != "hybrid":
        raise ConfigError(
            f"--hybrid-expiry drops the expired gradients of --consistency hybrid; it has no meaning "
            f"for --consistency {mode}: drop it or choose hybrid"
        )
    if replicated and mode == "hybrid":
        raise ConfigError(
            "--consistency hybrid keeps no embedding rows on the workers, so it cannot replicate "
            "tables there: drop --replicate-below or choose another --consistency"
        )


#: Largest ``--gba-buffer`` M and ``--gba-threshold`` iota (herald/ps/gba.py checks the same).
MAX_GBA_BUFFER = 4096
MAX_GBA_THRESHOLD = 1 << 20


def check_gba(
    mode: str,
    buffer: int,
    threshold: int,
    *,
    workers: int | None = None,
    global_batch: int | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    replicated: bool = False,
    groups: int = 1,
) -> None:
    """Check GBA's settings against the mode and the job (NOTE [gba tokens] in herald/ps/gba.py).

    Args:
        mode: the consistency mode.
        buffer: ``--gba-buffer`` M, contributions per global step, 0 = the number of workers.
        threshold: ``--gba-threshold`` iota: a gradient more than iota global steps stale is dropped.
        workers, global_batch: the job's workers and samples per global batch, when known
            (M must divide the global batch: micro-batches of ``global_batch / M`` samples).
        checkpoint_every, resume: accepted: GBA checkpoints at barriers and resumes, also from
            a BSP checkpoint and into BSP (NOTE [gba checkpoints] in herald/dispatch/gba.py).
        replicated, groups: settings GBA does not support yet.

    Raises:
        ConfigError: out of range, given to another mode, M not dividing the global batch,
            or combined with replicated tables or training groups.
    """
    if type(buffer) is not int or not 0 <= buffer <= MAX_GBA_BUFFER:
        raise ConfigError(
            f"--gba-buffer must be an integer in 0..{MAX_GBA_BUFFER} (0: the number of workers), got {buffer!r}"
        )
    if type(threshold) is not int or not 0 <= threshold <= MAX_GBA_THRESHOLD:
        raise ConfigError(
            f"--gba-threshold must be an integer in 0..{MAX_GBA_THRESHOLD} global steps, got {threshold!r}"
        )
    if mode != "gba":
        if buffer or threshold:
            raise ConfigError(
                f"--gba-buffer and --gba-threshold set GBA's gradient buffer; they have no meaning for "
                f"--consistency {mode}: drop them or choose gba"
            )
        return
    m = buffer or workers
    if m and global_batch and global_batch % m:
        raise ConfigError(
            f"--gba-buffer {m} must divide the global batch of {global_batch} samples (--workers x "
            "--batch-size): GBA keeps the synchronous global batch, in M micro-batches"
        )
    for bad, flag in ((replicated, "--replicate-below"), (groups > 1, "--groups")):
        if bad:
            raise ConfigError(f"--consistency gba does not support {flag} yet: drop it or choose another mode")
