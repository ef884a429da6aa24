"""The consistency modes as plug-ins: one :class:`ConsistencyMode` entry per mode, defined once.

A mode (``--consistency``; docs/consistency.md, "Adding a mode") touches every role of a job:
the worker's protocol, the dispatcher's serve loop, the PS ops its workers send, the
settings it reads, whether groups get a dispatcher each, and its part of the report. Each of
those parts asks :data:`MODES` (through :func:`consistency_mode`) instead of comparing the
mode's name, so a new mode is one new entry here plus the code its entry names.

Entry points
~~~~~~~~~~~~
This module is the contracts layer (:mod:`herald.contracts`): it may not import the worker,
dispatcher or job code its entries name (they sit above it and import it). So an entry
names that code as an *entry point*: a string ``"package.module:attribute"`` (the attribute
may be dotted, ``"module:Class.method"``), the style of Python packaging's entry points.
:func:`resolve` (or :meth:`ConsistencyMode.resolve`, which names the mode and the field in
its errors) imports the module with :mod:`importlib` and returns the attribute, when the
part that needs it asks, never at import: ``herald train`` checks its options without
torch, numba or zmq loaded. import-linter does not see these strings, which is the point:
the layers stay as they are (docs/design.md, "Layers").

What each reference resolves to:

- ``protocol``: a :class:`~herald.worker.protocol.ConsistencyProtocol` subclass, built as
  ``cls(executor, **protocol_settings(job))`` by each worker.
- ``serve``: a function ``serve(dispatcher) -> list[StepRecord]`` running the dispatcher's
  hand-out loop after its handshake (:meth:`herald.dispatch.dispatcher.Dispatcher.serve`).
- ``report``: a function ``block(cfg, records, total, settings, reads) -> dict`` building the
  report's ``consistency`` block (:func:`herald.job.report.consistency_block`): ``total`` the
  summed ack counters, ``settings`` the shared settings (``slow_worker``), ``reads`` the rows read.
- ``embedding_worker`` (optional): a factory ``(job, config, first_step, peers) -> worker``
  of a dispatcher-side embedding worker (hybrid's, NOTE [hybrid training] in
  herald/dispatch/hybrid.py), made when the dispatcher sends its first step.

Plain Python, like the rest of :mod:`herald.contracts`.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable
from typing import Any

from herald.contracts.consistency import check_consistency, check_gba, check_hybrid
from herald.contracts.vocab import CONSISTENCY_MODES
from herald.errors import ConfigError

#: An entry point: ``package.module:attribute`` (the attribute may be dotted).
REFERENCE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def resolve(reference: str) -> Any:
    """The object an entry point ``"package.module:attribute"`` names (imported on this call).

    Raises:
        ConfigError: a malformed reference, a module that does not exist, or a module
            without that attribute (the message names the reference). An ImportError
            raised *inside* an existing module (e.g. torch missing) is not hidden.
    """
    if not isinstance(reference, str) or not REFERENCE.fullmatch(reference):
        raise ConfigError(f"entry point {reference!r} is malformed: write 'package.module:attribute'")
    module_name, attribute = reference.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise  # the module exists; something it imports does not
        raise ConfigError(f"entry point {reference!r}: no module {module_name!r}") from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"entry point {reference!r}: {module_name} has no attribute {attribute!r}") from None
    return obj


def no_settings(job: Any) -> dict[str, Any]:
    """A mode whose protocol reads no setting of the job."""
    return {}


def bounded_settings(job: Any) -> dict[str, Any]:
    """HET's bound ``s`` (``--staleness``, NOTE [bounded reads] in herald/worker/consistency_bounded.py)."""
    return {"staleness": job.staleness}


def never(job: Any) -> bool:
    """False for every job (a mode's :attr:`ConsistencyMode.reads_early`)."""
    return False


def bounded_reads_early(job: Any) -> bool:
    """Bounded staleness reads early when its bound is above 0; at 0 its pulls ride on the
    step messages, as bsp's."""
    return job.staleness > 0


def gba_settings(job: Any) -> dict[str, Any]:
    """GBA's M and iota (``--gba-buffer``, ``--gba-threshold``; NOTE [gba tokens] in herald/ps/gba.py)."""
    return {"gba_buffer": job.gba_buffer, "gba_threshold": job.gba_threshold}


@dataclasses.dataclass(frozen=True)
class ConsistencyMode:
    """One consistency mode: what each role of a job runs under it (module docstring).

    Attributes:
        name: the ``--consistency`` value (one of :data:`herald.contracts.vocab.CONSISTENCY_MODES`).
        protocol: entry point of the worker's ``ConsistencyProtocol`` class.
        serve: entry point of the dispatcher's serve strategy, ``serve(dispatcher) -> records``.
        report: entry point of the function building the report's ``consistency`` block.
        ps_ops: the PS ops (:data:`herald.ps.wire.OPS`) the mode's workers send, for the
            record and the docs (the shard serves every op under every mode).
        protocol_settings: ``protocol_settings(job) -> dict``: the protocol's keyword settings
            from a :class:`~herald.contracts.job.JobSpec` (any object with its fields).
        flags: the :class:`~herald.contracts.train.TrainConfig` fields only this mode reads.
        settings_check: the function of :mod:`herald.contracts.consistency` checking those flags
            (each check runs for every job, and refuses its flags under another mode); None:
            no flags of its own.
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
        embedding_worker: entry point of a dispatcher-side embedding worker factory, or None
            (the workers write the PS themselves).
        reads_early: ``reads_early(job) -> bool``: the workers start pulls marked
            ``pull_early`` while the step before computes (NOTE [early pulls] in
            herald/dispatch/early.py), so the dispatcher computes the marks (bounded with
            s > 0). False (the default) where nothing reads them: bsp's pulls ride on the
            step messages (NOTE [step messages] in herald/ps/stepped.py), hybrid pulls
            every row unordered, gba builds no plan-driven micro-batches; the micro-batches
            then carry no marks (all False).
    """

    name: str
    protocol: str
    serve: str
    report: str
    ps_ops: tuple[str, ...]
    protocol_settings: Callable[[Any], dict[str, Any]] = no_settings
    flags: tuple[str, ...] = ()
    settings_check: Callable[..., None] | None = None
    independent_groups: bool = False
    planned_transmissions: bool = True
    inflight_steps: int = 2
    embedding_worker: str | None = None
    reads_early: Callable[[Any], bool] = never

    #: the fields holding entry points (:meth:`resolve`)
    REFERENCES = ("protocol", "serve", "report", "embedding_worker")

    def __post_init__(self) -> None:
        for field in self.REFERENCES:
            ref = getattr(self, field)
            if ref is None and field == "embedding_worker":  # optional
                continue
            if not (isinstance(ref, str) and REFERENCE.fullmatch(ref)):
                raise ConfigError(
                    f"consistency mode {self.name!r}: {field} {ref!r} is not an entry point 'package.module:attribute'"
                )

    def resolve(self, field: str) -> Any:
        """The object the entry point in ``field`` names (None for an unset optional one).

        Raises:
            ConfigError: ``field`` holds no entry point, or it does not resolve (names the
                mode, the field and the reference).
        """
        if field not in self.REFERENCES:
            raise ConfigError(
                f"consistency mode {self.name!r}: {field!r} is not one of its entry points {list(self.REFERENCES)}"
            )
        ref = getattr(self, field)
        if ref is None:
            return None
        try:
            return resolve(ref)
        except ConfigError as exc:
            raise ConfigError(f"consistency mode {self.name!r}, {field}: {exc}") from None


#: Every consistency mode by name, in the order of :data:`~herald.contracts.vocab.CONSISTENCY_MODES`.
MODES: dict[str, ConsistencyMode] = {
    m.name: m
    for m in (
        ConsistencyMode(  # exact: NOTE [step protocol] in herald/scheduler/plan.py
            name="bsp",
            protocol="herald.worker.protocol:BSP",
            serve="herald.dispatch.dispatcher:serve_steps",
            report="herald.job.report:plan_block",
            ps_ops=("step", "pull", "push_grad", "push_rows"),  # NOTE [step messages] in herald/ps/stepped.py
            inflight_steps=3,
        ),
        ConsistencyMode(  # HET: NOTE [bounded reads]; conditional pulls and clock advances ride on pull / push_rows
            name="bounded",
            protocol="herald.worker.consistency_bounded:Bounded",
            serve="herald.dispatch.dispatcher:serve_steps",
            report="herald.job.report:bounded_block",
            ps_ops=("step", "pull", "push_grad", "push_rows"),  # step messages at staleness 0
            inflight_steps=3,
            protocol_settings=bounded_settings,
            flags=("staleness",),
            settings_check=check_consistency,
            reads_early=bounded_reads_early,
        ),
        ConsistencyMode(  # Persia: NOTE [hybrid training]; the dispatcher's embedding worker sends push_grad
            name="hybrid",
            protocol="herald.worker.consistency_hybrid:Hybrid",
            serve="herald.dispatch.dispatcher:serve_steps",
            report="herald.job.report:hybrid_block",
            ps_ops=("pull",),
            flags=("hybrid_expiry",),
            settings_check=check_hybrid,
            independent_groups=True,
            planned_transmissions=False,
            embedding_worker="herald.dispatch.hybrid:make_hybrid",
        ),
        ConsistencyMode(  # GBA: NOTE [gba tokens] in herald/ps/gba.py
            name="gba",
            protocol="herald.worker.consistency_gba:GBA",
            serve="herald.dispatch.gba:serve_gba",
            report="herald.job.report:gba_block",
            ps_ops=("gba_pull", "gba_push"),
            protocol_settings=gba_settings,
            flags=("gba_buffer", "gba_threshold"),
            settings_check=check_gba,
        ),
    )
}

if tuple(MODES) != CONSISTENCY_MODES:  # the vocabulary and the registry name the same modes, in one order
    raise ImportError(
        f"herald.contracts.modes: MODES {tuple(MODES)} and herald.contracts.vocab.CONSISTENCY_MODES "
        f"{CONSISTENCY_MODES} differ: give every mode of the vocabulary one entry"
    )


def consistency_mode(name: str) -> ConsistencyMode:
    """The registry entry of mode ``name``.

    Raises:
        ConfigError: an unknown mode (the message lists the known ones).
    """
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown consistency mode {name!r}; choose one of {', '.join(MODES)}") from None
