"""Per-phase wall-clock accounting, shared by the worker, the dispatcher and the PS.

A :class:`PhaseTimer` adds the seconds spent in named phases; a step's breakdown is
taken (and reset) with :meth:`PhaseTimer.take`. The names of each role's phases are
listed here, in the order a step runs them, so that the report and the benchmarks
show them in one order (docs/design.md, "Performance": a user must see where a step goes).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

#: Worker phases, in step order (NOTE [step protocol]); ``compute`` is forward + backward
#: when the training loop does not time them separately (a user's own loop).
WORKER_PHASES = (
    "wait",
    "evict",
    "pull",
    "prefetch",
    "lookup",
    "forward",
    "backward",
    "compute",
    "grad_push",
    "local_update",
    "plan_push",
    "step_send",
    "replicas",
    "step_wait",
    "push_wait",
    "dense_allreduce",
    "ack",
)
#: Dispatcher stages: reading global batches, scheduling, building micro-batches,
#: sending them, and waiting for credit (acks).
DISPATCHER_PHASES = ("read", "schedule", "build", "send", "wait_build", "wait_credit")


class PhaseTimer:
    """Seconds per phase since the last :meth:`take`, exclusive: a phase entered inside
    another (``lookup`` inside ``forward``) is not counted twice (its time is taken out
    of the enclosing phase), so the phases of a step add up to its wall-clock time.

    Use ``with timer("pull"): ...`` or ``timer.add("pull", seconds)``. Not thread-safe:
    one timer per thread.
    """

    __slots__ = ("seconds", "_nested")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._nested: list[float] = []  # per open phase: seconds of the phases inside it

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            inner = self._nested.pop()
            if self._nested:
                self._nested[-1] += elapsed
            self.add(phase, elapsed - inner)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """Milliseconds per phase since the last call (then reset)."""
        out = {k: v * 1e3 for k, v in self.seconds.items()}
        self.seconds = {}
        return out


def ordered(phases_ms: dict[str, float], order: tuple[str, ...]) -> dict[str, float]:
    """``phases_ms`` with the known phases first, in ``order``, then any others sorted."""
    out = {k: phases_ms[k] for k in order if k in phases_ms}
    out.update({k: phases_ms[k] for k in sorted(phases_ms) if k not in out})
    return out
