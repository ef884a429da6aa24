"""The dispatcher's pipeline: scheduling and micro-batch building on background threads.

NOTE [dispatch pipeline]: the dispatcher's work runs in three stages, each on its own
thread, linked by bounded FIFO queues::

    plan thread:   read global batch t (already prefetched by the loader's thread),
                   scheduler.submit(t) -> the plan of step t-1       -> queue of `depth_plans`
    build thread:  early pulls of step t-1 (from step t-2's touched keys), cut and
                   compress the micro-batches, encode their frames   -> queue of `depth_ready`
    serve thread:  wait for credit, send the frames, receive acks, run barriers

Invariants:

- Order: each stage handles items in the order the one before produced them, so steps
  are numbered, built (and their NOTE [early pulls] computed) and sent in step order.
- Bounded work: at most ``depth_plans + depth_ready + 2`` steps exist beyond the last
  one sent (one in each stage's hands and the queues' slots), plus the batch the
  scheduler holds (it runs one step ahead) and the loader's prefetched batches.
- Barriers (NOTE [checkpoint barrier]): the plan thread emits a barrier item after the
  barrier's batch and then *waits* (:meth:`Pipeline.wait_resume`) until the serve
  thread has completed the barrier and called :meth:`Pipeline.resume`. Until then it
  reads no batch and makes no new scheduler, so the dispatcher's and the loader's
  positions at the barrier are exact, and the serve thread may use the scheduler
  (``flush``) and the batches (``state_dict``, commits) alone.
- Errors: an exception in a stage thread travels down the queues as an item and is
  re-raised by :meth:`Pipeline.get` in the serve thread (the same object: its
  traceback shows where it was raised); no thread dies silently.
- Bounded waits: every queue wait and the barrier wait poll ``poll_s`` at a time and
  give up when the pipeline is closed; :meth:`Pipeline.get` calls ``on_idle`` (the
  dispatcher's liveness check) while it waits. :meth:`Pipeline.close` joins the
  threads for at most ``timeout_s`` (a thread blocked in a source read is a daemon
  and is left behind: the return value says so).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from herald.errors import HeraldError

_END = ("end",)


class _Closed(Exception):
    """The pipeline was closed while a stage waited (ends the stage thread)."""


class Pipeline:
    """Two stage threads over ``produce()`` and ``build(item)`` feeding :meth:`get`.

    Args:
        produce: ``produce(pipeline)``, a generator function run on the plan thread (it
            calls ``pipeline.wait_resume()`` after yielding a barrier); its items go to ``build``.
        build: maps each item (on the build thread); its results come out of :meth:`get`.
        depth_plans, depth_ready: slots of the two queues (>= 1).
        poll_s: granularity of every wait.
        name: prefix of the thread names.
    """

    def __init__(
        self,
        produce: Callable[[Pipeline], Iterator[Any]],
        build: Callable[[Any], Any],
        *,
        depth_plans: int = 1,
        depth_ready: int = 2,
        poll_s: float = 0.05,
        name: str = "herald-dispatch",
    ):
        if depth_plans < 1 or depth_ready < 1:
            raise ValueError("pipeline queues need at least one slot each")
        self._produce, self._build, self._poll_s = produce, build, poll_s
        self._plans: queue.Queue = queue.Queue(depth_plans)
        self._ready: queue.Queue = queue.Queue(depth_ready)
        self._closing = threading.Event()
        self._resume = threading.Event()
        self._threads = [
            threading.Thread(target=self._run_plans, name=f"{name}-plan", daemon=True),
            threading.Thread(target=self._run_build, name=f"{name}-build", daemon=True),
        ]
        self._started = self._ended = False

    def start(self) -> None:
        self._started = True
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ consumer side
    def get(self, on_idle: Callable[[], None] | None = None, idle_every_s: float = 0.5) -> Any:
        """The next built item, or ``("end",)`` once ``produce`` is exhausted.

        Raises:
            BaseException: whatever a stage raised (re-raised here, traceback kept).
            HeraldError: the pipeline was closed, or its threads ended without a result (a bug).
        """
        if self._ended:
            return _END
        next_idle = time.monotonic() + idle_every_s
        while True:
            try:
                kind, payload = self._ready.get(timeout=self._poll_s)
                break
            except queue.Empty:
                if self._closing.is_set():
                    raise HeraldError("the dispatcher was closed while serving (NOTE [dispatch pipeline])") from None
                if not any(t.is_alive() for t in self._threads) and self._ready.empty():
                    raise HeraldError(
                        "the dispatcher's pipeline threads ended without a result; this is a bug "
                        "(NOTE [dispatch pipeline])"
                    ) from None
                if on_idle is not None and time.monotonic() >= next_idle:
                    on_idle()
                    next_idle = time.monotonic() + idle_every_s
        if kind == "error":
            self._ended = True
            raise payload
        if kind == "end":
            self._ended = True
            return _END
        return payload

    def resume(self) -> None:
        """Let the plan thread go on after the barrier it waits at (serve thread)."""
        self._resume.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop both threads and join them within ``timeout_s`` in all (:attr:`ended` then
        says whether they did); idempotent."""
        self._closing.set()
        if not self._started:
            return
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def ended(self) -> bool:
        """Whether both threads have ended (or never started)."""
        return not self._started or not any(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------ producer side
    def wait_resume(self) -> None:
        """Block the plan thread until :meth:`resume` (call it from ``produce`` right
        after yielding a barrier item); raises :class:`_Closed` on close."""
        while not self._resume.wait(self._poll_s):
            if self._closing.is_set():
                raise _Closed()
        self._resume.clear()

    def _put(self, q: queue.Queue, item: tuple) -> None:
        while True:
            if self._closing.is_set():
                raise _Closed()
            try:
                q.put(item, timeout=self._poll_s)
                return
            except queue.Full:
                continue

    def _get(self, q: queue.Queue) -> tuple:
        while True:
            if self._closing.is_set():
                raise _Closed()
            try:
                return q.get(timeout=self._poll_s)
            except queue.Empty:
                continue

    def _run_plans(self) -> None:
        try:
            for item in self._produce(self):
                self._put(self._plans, ("item", item))
            self._put(self._plans, ("end", None))
        except _Closed:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the serve thread
            self._hand_off(self._plans, exc)

    def _run_build(self) -> None:
        try:
            while True:
                kind, payload = self._get(self._plans)
                if kind == "item":
                    self._put(self._ready, ("item", self._build(payload)))
                    continue
                self._put(self._ready, (kind, payload))
                return
        except _Closed:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the serve thread
            self._hand_off(self._ready, exc)

    def _hand_off(self, q: queue.Queue, exc: BaseException) -> None:
        """Pass a stage's failure down the pipeline (unless it is being closed)."""
        try:
            self._put(q, ("error", exc))
        except _Closed:
            pass
