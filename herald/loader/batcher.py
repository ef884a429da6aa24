"""GlobalBatcher: fixed-size global batches from a Source, prefetched by a thread.

NOTE [batcher protocol]:

- A background thread produces batches into a queue of ``prefetch_batches`` slots
  (bounded in-flight work: at most ``prefetch_batches + 1`` batches exist beyond
  the consumer's). Each queued batch carries the batcher state *after* it, and the
  consumer's ``state_dict()`` is the state of the last batch it received, so a
  saved state never includes batches that were prefetched but not consumed.
- An exception in the thread is queued and re-raised by the consumer's next
  ``__next__``; the thread never dies silently. Every queue wait has a timeout
  and checks that the thread is alive.
- ``close(timeout_s)`` sets a stop flag, drains the queue and joins the thread for
  at most ``timeout_s``; a thread blocked in ``source.read`` is a daemon and is
  left behind (:attr:`~GlobalBatcher.prefetching` stays True). The batcher does not close the source.
- Epochs: at the end of the source the batcher reloads the source state it saw at
  construction (normally the start) and reads it again. Each epoch ends with a
  short batch of the remaining rows, unless ``drop_last`` drops it.
- Shuffle: NOTE [shuffle buffer] in :mod:`herald.loader.shuffle`, a buffer of
  ``max(shuffle_buffer, batch_size)`` rows; each step emits ``batch_size`` rows drawn
  uniformly (without replacement) from the buffer with
  ``np.random.default_rng([seed, epoch])`` and refills their slots with the next
  source rows; at the end of the source the buffer is permuted and emitted (a short
  final batch unless ``drop_last``). Resume with shuffle restores the
  position by replay (torchdata's snapshot + skip-ahead): the epoch is re-read from
  its start and the first ``batches`` batches are regenerated and dropped; without
  shuffle the source position is restored directly. The batcher owns the source from
  construction: it is repositioned only on a resume or a new epoch.
- ``prefetch_batches=0``: no thread; batches are read in the consumer's thread by the
  same code (for sources whose client is not thread-safe, e.g. a Kafka consumer that
  the caller also commits through).
- Tracker (:class:`ReadTracker`, optional, needs ``shuffle_buffer=0``): called in the
  thread that reads, ``reset(source)`` after every reposition (and at the start),
  ``after_read(source, rows)`` after every read, ``take(rows)`` once per batch formed
  of the rows read since the previous ``take``; what ``take`` returns travels with the
  batch and is :attr:`GlobalBatcher.last_tracked` once the consumer received it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

import numpy as np

from herald.config import require
from herald.errors import ConfigError, DataError
from herald.loader.batch import SampleBatch
from herald.loader.shuffle import ShuffleBuffer
from herald.loader.source import Source


@dataclasses.dataclass(frozen=True)
class BatcherSettings:
    """Args: batch_size: samples per global batch (>= 1); drop_last: drop each epoch's
    short final batch; shuffle_buffer: rows in the shuffle buffer (0 = no shuffle);
    seed: shuffle seed; epochs: passes over the source (>= 1); prefetch_batches:
    queue slots (>= 1), or 0 for no prefetch thread; poll_ms: queue wait granularity
    for liveness checks."""

    batch_size: int
    drop_last: bool = False
    shuffle_buffer: int = 0
    seed: int = 0
    epochs: int = 1
    prefetch_batches: int = 2
    poll_ms: int = 50

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        require(self.shuffle_buffer >= 0, f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        require(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")
        require(
            self.prefetch_batches >= 0,
            f"prefetch_batches must be >= 0 (0: no prefetch thread), got {self.prefetch_batches}",
        )
        require(self.poll_ms >= 1, f"poll_ms must be >= 1, got {self.poll_ms}")


class ReadTracker:
    """What a :class:`GlobalBatcher` records per batch besides its rows (a strategy; see
    the tracker part of NOTE [batcher protocol]). The base records nothing.

    Example: :class:`herald.loader.global_batches.KafkaRecords` (record sample ids and
    the topic position after each batch).
    """

    def reset(self, source: Source) -> None:
        """``source`` was positioned (start, resume or new epoch): forget partial reads."""

    def after_read(self, source: Source, rows: int) -> None:
        """``rows`` rows were just read from ``source``."""

    def take(self, rows: int):
        """What the batch of the ``rows`` rows read since the last ``take`` carries."""
        return None


def _read_exact(source: Source, n: int, tracker: ReadTracker | None = None) -> list[SampleBatch]:
    """Read up to ``n`` rows (fewer only at the end of the source)."""
    parts, have = [], 0
    while have < n:
        b = source.read(n - have)
        if b is None:
            break
        if tracker is not None:
            tracker.after_read(source, len(b))
        parts.append(b)
        have += len(b)
    return parts


class GlobalBatcher:
    """Iterable of SampleBatch with exactly ``batch_size`` samples (see NOTE [batcher protocol]).

    Args: source: any Source (owned by the batcher from here on, but not closed by it);
        tracker: a :class:`ReadTracker` or None; the others as :class:`BatcherSettings`.

    Raises:
        ConfigError: invalid settings; DataError: from the source, re-raised by ``__next__``.
    """

    def __init__(
        self,
        source: Source,
        batch_size: int,
        *,
        drop_last: bool = False,
        shuffle_buffer: int = 0,
        seed: int = 0,
        epochs: int = 1,
        prefetch_batches: int = 2,
        tracker: ReadTracker | None = None,
    ):
        self.settings = BatcherSettings(batch_size, drop_last, shuffle_buffer, seed, epochs, prefetch_batches)
        if tracker is not None and shuffle_buffer:
            raise ConfigError("a ReadTracker follows the rows in read order; use shuffle_buffer=0 with a tracker")
        self.source, self.tracker = source, tracker
        self._start_state = source.state_dict()
        self._state = {"epoch": 0, "batches": 0, "source": self._start_state}
        self._moved = False  # the source left its construction state (reposition before reading)
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._items = None  # the producing generator when prefetch_batches == 0
        self._stop = threading.Event()
        self._done = False
        self._batches = self._rows = 0
        #: what the tracker's ``take`` returned for the batch ``__next__`` returned last.
        self.last_tracked = None

    # --------------------------------------------------------------- consumer
    def __iter__(self) -> GlobalBatcher:
        return self

    def __next__(self) -> SampleBatch:
        if self._done:
            raise StopIteration
        if self._thread is None and self._items is None:
            self._start()
        kind, payload, state, tracked = self._next_item()
        if kind == "batch":
            self._state = state
            self._batches += 1
            self._rows += len(payload)
            self.last_tracked = tracked
            return payload
        self._done = True
        self._join(0.0)
        if kind == "error":
            raise payload
        raise StopIteration

    def _next_item(self) -> tuple:
        if self._items is not None:  # no prefetch thread: produce here
            try:
                return next(self._items)
            except StopIteration:
                return ("end", None, None, None)
            except Exception as exc:  # noqa: BLE001 - raised by __next__ after the bookkeeping
                return ("error", exc, None, None)
        timeout = self.settings.poll_ms / 1000
        while True:
            try:
                return self._queue.get(timeout=timeout)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise DataError("the prefetch thread ended without a result; this is a bug") from None

    @property
    def stats(self) -> dict:
        """Batches and rows delivered, the current epoch, and the source's stats."""
        return {
            "batches": self._batches,
            "rows": self._rows,
            "epoch": self._state["epoch"],
            "source": self.source.stats,
        }

    def state_dict(self) -> dict:
        """Position after the last batch returned by ``__next__``."""
        s = self.settings
        return {
            "format": "global_batcher",
            "batch_size": s.batch_size,
            "shuffle_buffer": s.shuffle_buffer,
            "seed": s.seed,
            "drop_last": s.drop_last,
            **self._state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; stops a running prefetch thread first.

        Raises:
            DataError: malformed state; ConfigError: saved with other settings.
        """
        if not isinstance(state, dict) or state.get("format") != "global_batcher":
            raise DataError("not a GlobalBatcher state; pass GlobalBatcher.state_dict()")
        for key in ("epoch", "batches"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise DataError(f"malformed batcher state: {key!r} must be an int >= 0")
        s = self.settings
        for key in ("batch_size", "shuffle_buffer", "seed", "drop_last"):
            if state.get(key) != getattr(s, key):
                raise ConfigError(
                    f"state saved with {key}={state.get(key)!r}, this batcher has "
                    f"{getattr(s, key)!r}; construct it with the same settings"
                )
        if not isinstance(state.get("source"), dict):
            raise DataError("malformed batcher state: 'source' must be a source state dict")
        self.close()
        self._stop = threading.Event()
        self._thread, self._items, self._done = None, None, state["epoch"] >= s.epochs
        self._moved = True
        self._state = {"epoch": state["epoch"], "batches": state["batches"], "source": state["source"]}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the prefetch thread within ``timeout_s`` seconds; idempotent. A thread still
        blocked in ``source.read`` then is a daemon, abandoned (:attr:`prefetching`)."""
        self._stop.set()
        self._done = True
        if self._items is not None:
            self._items.close()
        self._join(timeout_s)

    @property
    def prefetching(self) -> bool:
        """Whether the prefetch thread runs (after :meth:`close`: blocked in ``source.read``)."""
        return self._thread is not None and self._thread.is_alive()

    def _join(self, timeout_s: float) -> None:
        if self._thread is None:
            return
        if self._queue is not None:
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
        self._thread.join(timeout_s)

    def __enter__(self) -> GlobalBatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------- producer
    def _start(self) -> None:
        if self.settings.prefetch_batches == 0:
            self._items = self._produce(dict(self._state), self._stop)
            return
        self._queue = queue.Queue(maxsize=self.settings.prefetch_batches)
        self._thread = threading.Thread(
            target=self._run, args=(dict(self._state), self._stop, self._queue), name="herald-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, state: dict, stop: threading.Event, q: queue.Queue) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=self.settings.poll_ms / 1000)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            for item in self._produce(state, stop):
                if not put(item) or stop.is_set():
                    return
            put(("end", None, None, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(("error", exc, None, None))

    def _produce(self, state: dict, stop: threading.Event):
        """("batch", batch, state after it, tracked) items from ``state`` on, in the
        thread that reads (the prefetch thread, or the consumer's with no prefetch)."""
        shuffle = self.settings.shuffle_buffer > 0
        skip = state["batches"] if shuffle else 0
        self._reposition(self._start_state if shuffle else state["source"])
        for epoch in range(state["epoch"], self.settings.epochs):
            n = 0 if shuffle else state["batches"]
            for batch in self._shuffled(epoch) if shuffle else self._sequential():
                n += 1
                tracked = self.tracker.take(len(batch)) if self.tracker is not None else None
                if skip:
                    skip -= 1
                    continue
                yield ("batch", batch, {"epoch": epoch, "batches": n, "source": self.source.state_dict()}, tracked)
                if stop.is_set():
                    return
            state = {"batches": 0}
            if epoch + 1 < self.settings.epochs:
                self._moved = True
                self._reposition(self._start_state)

    def _reposition(self, source_state: dict) -> None:
        """Move the source to ``source_state`` unless it has not moved since construction
        (a Kafka source must not drop what it fetched before the first read)."""
        if self._moved:
            self.source.load_state_dict(source_state)
        self._moved = True
        if self.tracker is not None:
            self.tracker.reset(self.source)

    def _sequential(self):
        b, drop = self.settings.batch_size, self.settings.drop_last
        while True:
            parts = _read_exact(self.source, b, self.tracker)
            have = sum(len(p) for p in parts)
            if have == b or (have and not drop):
                yield SampleBatch.concat(parts)
            elif have and self.tracker is not None:
                self.tracker.take(have)  # the dropped rows
            if have < b:
                return

    def _shuffled(self, epoch: int):
        s = self.settings
        buf = ShuffleBuffer(np.random.default_rng([s.seed, epoch]), s.batch_size)
        parts = _read_exact(self.source, max(s.shuffle_buffer, s.batch_size))
        if parts:
            buf.fill(SampleBatch.concat(parts))
        while True:
            new = _read_exact(self.source, s.batch_size)
            if sum(len(p) for p in new) == s.batch_size:
                yield buf.step(SampleBatch.concat(new))
                continue
            rest = buf.drain(SampleBatch.concat(new) if new else None)
            if rest is None:
                return
            for i in range(0, len(rest), s.batch_size):
                out = rest.slice(i, i + s.batch_size)
                if len(out) == s.batch_size or not s.drop_last:
                    yield out
            return
