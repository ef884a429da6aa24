"""The consistency modes: one :class:`ConsistencyMode` entry per mode, with its settings class, defined once.

A mode (``--consistency``; docs/consistency.md, "Adding a mode") touches every role of a job:
the worker's protocol, the dispatcher's serve loop and embedding worker, the PS ops its
workers send, its part of the report. This module holds what the contracts layer can: the
mode's name, its settings (a :class:`~herald.contracts.consistency.ModeSettings` subclass,
validated on construction and checked against the job by :func:`check_mode`) and the facts
every role reads (:class:`ConsistencyMode`). Each role keeps its own registry of objects
keyed by mode name, beside the code it runs: the worker's protocols
(:data:`herald.worker.modes.PROTOCOLS`), the dispatcher's serve strategies and embedding
workers (:data:`herald.dispatch.modes.DISPATCH`), the PS's op sets
(:data:`herald.ps.modes.OP_SETS`), the report's blocks
(:data:`herald.job.report.consistency.CONSISTENCY_BLOCKS`).
tests/contracts/test_modes.py checks that every registry has exactly the modes of
:data:`herald.contracts.vocab.CONSISTENCY_MODES`.

The settings nest once in :class:`~herald.contracts.train.TrainConfig` and
:class:`~herald.contracts.job.JobSpec` (their field ``mode``), while the command line stays
flat: :data:`MODE_FLAGS` gives ``--consistency`` and every mode's options (``--staleness``,
``--hybrid-expiry``, ``--gba-buffer``, ``--gba-threshold``), refusing a mode's option given
to another mode.

Plain Python, like the rest of :mod:`herald.contracts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from herald.config import Nested, Option, from_mapping, setting
from herald.contracts.consistency import ModeContext, ModeSettings, integer_in
from herald.contracts.vocab import CONSISTENCY_MODES
from herald.errors import ConfigError

#: Largest staleness bound ``s`` (clock ticks = updates of one embedding).
MAX_STALENESS = 1 << 20
#: Largest ``--hybrid-expiry`` (steps a buffered sample waits for its gradient).
MAX_HYBRID_EXPIRY = 1 << 20
#: Largest ``--gba-buffer`` M and ``--gba-threshold`` iota (herald/ps/gba.py checks the same).
MAX_GBA_BUFFER = 4096
MAX_GBA_THRESHOLD = 1 << 20


@dataclasses.dataclass(frozen=True)
class BspSettings(ModeSettings):
    """Bulk-synchronous, exact (NOTE [step protocol] in herald/contracts/plan.py): no settings."""

    name = "bsp"


@dataclasses.dataclass(frozen=True)
class BoundedSettings(ModeSettings):
    """HET's clock-bounded reads (HET §3.3, §4.1; NOTE [bounded reads] in herald/worker/consistency_bounded.py).

    Attributes:
        staleness: the bound ``s``, in updates of one embedding, 0..:data:`MAX_STALENESS` (0: exact BSP).

    Raises:
        ConfigError: ``staleness`` out of range.
    """

    name = "bounded"
    staleness: int = setting(
        0, "--consistency bounded: staleness bound s in updates of one embedding (0 = exact BSP)", metavar="S"
    )

    def __post_init__(self) -> None:
        if not integer_in(self.staleness, 0, MAX_STALENESS):
            raise ConfigError(f"--staleness must be an integer in 0..{MAX_STALENESS}, got {self.staleness!r}")

    @property
    def reads_early(self) -> bool:
        """Above 0 the workers read early; at 0 their pulls ride on the step messages, as bsp's."""
        return self.staleness > 0

    def described(self) -> tuple[str, bool]:
        return f"--staleness {self.staleness} bounds the reads of --consistency bounded", True


@dataclasses.dataclass(frozen=True)
class HybridSettings(ModeSettings):
    """Persia's hybrid training (Persia §3, §4.2; NOTE [hybrid training] in herald/dispatch/hybrid.py).

    Attributes:
        expiry_steps: steps a sample's ID features wait in the dispatcher's buffer for their
            gradient before they are dropped (counted), 0..:data:`MAX_HYBRID_EXPIRY`; None:
            never (the credit window bounds it).

    Raises:
        ConfigError: ``expiry_steps`` out of range.
    """

    name = "hybrid"
    expiry_steps: int | None = setting(
        None, "hybrid: drop and count gradients over STEPS steps late", metavar="STEPS", dest="hybrid_expiry"
    )

    def __post_init__(self) -> None:
        if self.expiry_steps is not None and not integer_in(self.expiry_steps, 0, MAX_HYBRID_EXPIRY):
            raise ConfigError(
                f"--hybrid-expiry must be an integer in 0..{MAX_HYBRID_EXPIRY} steps, got {self.expiry_steps!r}"
            )

    def check(self, job: ModeContext) -> None:
        """Hybrid's workers hold no embedding rows, so they replicate no table (``--replicate-below``)."""
        if job.replicated:
            raise ConfigError(
                "--consistency hybrid keeps no embedding rows on the workers, so it cannot replicate "
                "tables there: drop --replicate-below or choose another --consistency"
            )

    def described(self) -> tuple[str, bool]:
        return "--hybrid-expiry drops the expired gradients of --consistency hybrid", True


@dataclasses.dataclass(frozen=True)
class GbaSettings(ModeSettings):
    """GBA's token-controlled global-batch aggregation on the PS (GBA §4.1; NOTE [gba tokens] in herald/ps/gba.py).

    Attributes:
        buffer: M, contributions per global step, 0..:data:`MAX_GBA_BUFFER` (0: the number
            of workers, resolved by :meth:`for_job`).
        threshold: iota: a gradient more than iota global steps stale is dropped,
            0..:data:`MAX_GBA_THRESHOLD`.

    Raises:
        ConfigError: a value out of range.
    """

    name = "gba"
    buffer: int = setting(
        0, "gba: gradients aggregated per global step, M (0: --workers)", metavar="M", dest="gba_buffer"
    )
    threshold: int = setting(
        0, "gba: drop (count) gradients > IOTA global steps stale", metavar="IOTA", dest="gba_threshold"
    )

    def __post_init__(self) -> None:
        if not integer_in(self.buffer, 0, MAX_GBA_BUFFER):
            raise ConfigError(
                f"--gba-buffer must be an integer in 0..{MAX_GBA_BUFFER} (0: the number of workers), "
                f"got {self.buffer!r}"
            )
        if not integer_in(self.threshold, 0, MAX_GBA_THRESHOLD):
            raise ConfigError(
                f"--gba-threshold must be an integer in 0..{MAX_GBA_THRESHOLD} global steps, got {self.threshold!r}"
            )

    def check(self, job: ModeContext) -> None:
        """M divides the global batch (micro-batches of ``global_batch / M`` samples); no
        replicated tables, no training groups yet. Checkpoints and ``--resume`` are fine:
        GBA checkpoints at barriers and resumes, also from a BSP checkpoint and into BSP
        (NOTE [gba checkpoints] in herald/dispatch/gba.py)."""
        m = self.buffer or job.workers
        if m and job.global_batch and job.global_batch % m:
            raise ConfigError(
                f"--gba-buffer {m} must divide the global batch of {job.global_batch} samples (--workers x "
                "--batch-size): GBA keeps the synchronous global batch, in M micro-batches"
            )
        for bad, flag in ((job.replicated, "--replicate-below"), (job.groups > 1, "--groups")):
            if bad:
                raise ConfigError(f"--consistency gba does not support {flag} yet: drop it or choose another mode")

    def for_job(self, job: ModeContext) -> GbaSettings:
        """M resolved: ``buffer``, or the job's workers when 0."""
        return dataclasses.replace(self, buffer=self.buffer or job.workers or 0)

    def micro_batch_rows(self, batch_size_per_worker: int, num_workers: int) -> int:
        """The global batch over its M micro-batches (``buffer`` resolved; unresolved: one worker's batch)."""
        return batch_size_per_worker * num_workers // self.buffer if self.buffer else batch_size_per_worker

    def described(self) -> tuple[str, bool]:
        return "--gba-buffer and --gba-threshold set GBA's gradient buffer", False


@dataclasses.dataclass(frozen=True)
class ConsistencyMode:
    """One consistency mode: what the contracts layer says of it (module docstring).

    Attributes:
        name: the ``--consistency`` value (one of :data:`herald.contracts.vocab.CONSISTENCY_MODES`).
        settings: its :class:`~herald.contracts.consistency.ModeSettings` subclass (``settings.name == name``).
        independent_groups: ``--groups G`` runs one dispatcher per group (NOTE [independent
            groups] in herald/job/group_dispatch.py) instead of one for the job.
        planned_transmissions: the report's ``transmissions`` are the communication plan's,
            counted per cause by the dispatcher; False: no plan runs (hybrid), so the report
            counts every row read (the block's ``reads``) as ``miss_pull`` and every gradient
            row pushed (its ``gradient_rows_pushed``) as ``grad_push``.
        inflight_steps: the credit window when ``--max-inflight-steps`` is not given. 3 where
            a worker's step message waits for the next micro-batch (NOTE [step messages] in
            herald/ps/stepped.py): step t + 1 is then sent once step t - 2 is acked, a whole
            step before it is needed, so the dispatcher's ack-to-send latency stays off the
            step. 2 where the window bounds staleness (hybrid) or is a worker's credit (gba).
        embedding_worker: the dispatcher runs an embedding worker that writes the PS (hybrid's,
            NOTE [hybrid training] in herald/dispatch/hybrid.py): the workers' acks carry their
            gradients by sample id. False: the workers write the PS themselves.

    Raises:
        ConfigError: a settings class of another name.
    """

    name: str
    settings: type[ModeSettings]
    independent_groups: bool = False
    planned_transmissions: bool = True
    inflight_steps: int = 2
    embedding_worker: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.settings, type) and issubclass(self.settings, ModeSettings)):
            raise ConfigError(f"consistency mode {self.name!r}: settings must be a ModeSettings subclass")
        if self.settings.name != self.name:
            raise ConfigError(f"consistency mode {self.name!r}: its settings class is {self.settings.name!r}'s")


#: Every consistency mode by name, in the order of :data:`~herald.contracts.vocab.CONSISTENCY_MODES`.
MODES: dict[str, ConsistencyMode] = {
    m.name: m
    for m in (
        ConsistencyMode(name="bsp", settings=BspSettings, inflight_steps=3),  # exact: NOTE [step protocol]
        ConsistencyMode(name="bounded", settings=BoundedSettings, inflight_steps=3),  # HET: NOTE [bounded reads]
        ConsistencyMode(  # Persia: NOTE [hybrid training]; the dispatcher's embedding worker pushes the gradients
            name="hybrid",
            settings=HybridSettings,
            independent_groups=True,
            planned_transmissions=False,
            embedding_worker=True,
        ),
        ConsistencyMode(name="gba", settings=GbaSettings),  # GBA: NOTE [gba tokens] in herald/ps/gba.py
    )
}

if tuple(MODES) != CONSISTENCY_MODES:  # the vocabulary and the registry name the same modes, in one order
    raise ImportError(
        f"herald.contracts.modes: MODES {tuple(MODES)} and herald.contracts.vocab.CONSISTENCY_MODES "
        f"{CONSISTENCY_MODES} differ: give every mode of the vocabulary one entry"
    )


def consistency_mode(name: object) -> ConsistencyMode:
    """The registry entry of mode ``name`` (a ``--consistency`` value).

    Raises:
        ConfigError: an unknown mode, or not a string (the message lists the known ones).
    """
    entry = MODES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError(f"unknown consistency mode {name!r}; choose one of {', '.join(MODES)}")
    return entry


def check_mode(settings: ModeSettings, job: ModeContext) -> None:
    """Check a job's mode settings: those of a mode of :data:`MODES`, against ``job``
    (:meth:`ModeSettings.check`), the one check every mode's settings go through.

    Raises:
        ConfigError: an unknown mode, a settings object of another class than its mode's,
            or what the mode's check refuses.
    """
    entry = consistency_mode(getattr(settings, "name", None))
    if type(settings) is not entry.settings:
        raise ConfigError(
            f"--consistency {entry.name} takes a {entry.settings.__name__}, got {type(settings).__name__}"
        )
    settings.check(job)


def mode_from_dict(mapping: Mapping[str, Any]) -> ModeSettings:
    """The settings of :meth:`ModeSettings.to_dict` (``{"name": mode, field: value, ...}``).

    Raises:
        ConfigError: not a mapping, an unknown mode, an unknown field or a bad value.
    """
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"a mode's settings must be a mapping, got {type(mapping).__name__}")
    values = dict(mapping)
    entry = consistency_mode(values.pop("name", None))
    return from_mapping(entry.settings, values, where=f"--consistency {entry.name} settings")


class ModeFlags:
    """The flat options of a job's mode settings (:func:`herald.config.nested`'s ``flags``):
    ``--consistency`` and every mode's own options, in registry order; a mode's option given
    (not at its default) to another mode is refused (:meth:`ModeSettings.misplaced`)."""

    consistency = Option(
        "consistency",
        "bsp",
        str,
        {
            "help": "consistency protocol of the embeddings (docs/consistency.md): bsp (exact, "
            "equal to single-process training), bounded (HET's bound on reads: a cached "
            "copy at most --staleness updates behind is read instead of re-pulled; writes "
            "stay exact), hybrid (Persia: workers hold no embeddings and return gradients "
            "by sample id; the dispatcher, as Persia's embedding worker, pushes them "
            "asynchronously: reads at most --max-inflight-steps - 1 steps stale; dense "
            "exact), gba (GBA: the PS applies --gba-buffer gradients per global step, "
            "dropping those over --gba-threshold steps stale)",
            "choices": CONSISTENCY_MODES,
        },
    )

    def options(self) -> list[Option]:
        return [self.consistency, *(o for m in MODES.values() for o in Nested(m.settings).options())]

    def build(self, values: Mapping[str, Any]) -> ModeSettings:
        """The chosen mode's settings from the options given (flat names).

        Raises:
            ConfigError: an unknown ``--consistency``, a value out of range (every mode's
                options are checked), or an option of another mode given.
        """
        name = values.get("consistency", "bsp")
        if not isinstance(name, str) or name not in MODES:
            raise ConfigError(f"--consistency must be one of {', '.join(CONSISTENCY_MODES)}, got {name!r}")
        built = {mode.name: Nested(mode.settings).build(values) for mode in MODES.values()}
        for mode in MODES.values():
            if mode.name != name and built[mode.name] != mode.settings():
                raise ConfigError(built[mode.name].misplaced(name))
        return built[name]

    def flatten(self, settings: ModeSettings) -> dict[str, Any]:
        """Every option: the chosen mode's settings, the other modes' defaults."""
        out: dict[str, Any] = {"consistency": settings.name}
        for mode in MODES.values():
            out.update(Nested(mode.settings).flatten(settings if mode.name == settings.name else mode.settings()))
        return out


#: The options of the ``mode`` field of :class:`~herald.contracts.train.TrainConfig`.
MODE_FLAGS = ModeFlags()
