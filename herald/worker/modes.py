"""The worker's registry of the consistency modes: each mode's :class:`~herald.worker.protocol.ConsistencyProtocol`.

One entry per mode of :data:`herald.contracts.vocab.CONSISTENCY_MODES`, keyed by its name
(the protocol class's ``name``, its settings class's: :mod:`herald.contracts.modes`); a new
mode adds its protocol here (docs/consistency.md, "Adding a mode").
"""

from __future__ import annotations

from typing import Any

from herald.contracts.modes import consistency_mode
from herald.errors import ConfigError
from herald.worker.consistency_bounded import Bounded
from herald.worker.consistency_gba import GBA
from herald.worker.consistency_hybrid import Hybrid
from herald.worker.executor import PlanExecutor
from herald.worker.protocol import BSP, ConsistencyProtocol
from herald.worker.warm import load_cache

#: Each mode's worker protocol, by mode name.
PROTOCOLS: dict[str, type[ConsistencyProtocol]] = {cls.name: cls for cls in (BSP, Bounded, Hybrid, GBA)}


def job_protocol(job: Any, executor: PlanExecutor) -> ConsistencyProtocol:
    """The protocol of ``job`` (a :class:`~herald.contracts.job.JobSpec`) over ``executor``, with
    the job's mode settings (:meth:`ConsistencyProtocol.for_settings`); when the job resumes
    the worker caches (``resume_caches``), the executor's cache and the protocol's per-copy
    state are loaded from the checkpoint (NOTE [warm resume] in herald/dispatch/warm.py).

    Raises:
        ConfigError: a mode without a protocol here (the message lists the known modes).
    """
    name = consistency_mode(job.mode.name).name
    if name not in PROTOCOLS:
        raise ConfigError(f"no worker protocol for --consistency {name}; known: {', '.join(PROTOCOLS)}")
    protocol = PROTOCOLS[name].for_settings(executor, job.mode)
    if job.resume_caches:
        load_cache(job.resume_dense, executor.rank, executor, protocol)
    return protocol
