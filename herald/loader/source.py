"""The interface every sample source implements (files, synthetic data, Kafka).

A source is a cursor over records. ``read(max_rows)`` returns the next rows as a
:class:`SampleBatch` (at most ``max_rows``, at least one) or ``None`` at the end of
data. ``state_dict()`` is the position right after the last row returned;
``load_state_dict(state)`` moves there so that the following reads return exactly
what an uninterrupted run would (record-level resume, tested for every source by
``tests/loader/resume_harness.py``).
"""

from __future__ import annotations

from herald.errors import DataError
from herald.loader.batch import SampleBatch, Schema


class Source:
    """Base class. Subclasses implement ``schema``, ``_read``, ``_get_state``, ``_set_state``.

    The base fixes the public calls (as torchdata's ``BaseNode``): it validates
    ``max_rows``, wraps states as ``{"format": ..., "rows": ..., **sub_state}`` and
    checks a state's format before handing it to the subclass.
    """

    format_name = "source"

    def __init__(self) -> None:
        self._rows = 0
        self._closed = False

    # ----------------------------------------------------------------- public
    @property
    def schema(self) -> Schema:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def num_rows(self) -> int | None:
        """Number of good rows when known cheaply (without decoding), else None."""
        return None

    @property
    def multi_hot_tables(self) -> frozenset[str]:
        """Tables whose samples may hold more than one id (list columns in Parquet)."""
        return frozenset()

    @property
    def stats(self) -> dict:
        """``rows`` (returned so far), ``skipped`` (reason -> count) and source extras."""
        return {"rows": self._rows, "skipped": dict(self._skipped())}

    def lag(self) -> dict | None:
        """How far the reads are behind a stream's end (NOTE [lag] in
        herald/loader/kafka/source.py): ``records`` (partition -> records between the read
        position and the log end), ``event_time_s`` (seconds from the newest record read, by
        its timestamp, to now; None without timestamps). None: a source with no moving end
        (files, synthetic data)."""
        return None

    def read(self, max_rows: int) -> SampleBatch | None:
        """Up to ``max_rows`` (int >= 1) next rows, or None at the end of data.

        Raises:
            DataError: a bad record under the ``strict`` policy, or unreadable input.
            ValueError: ``max_rows < 1``.
        """
        if self._closed:
            raise DataError(f"{self.format_name} source is closed; open a new one")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        batch = self._read(int(max_rows))
        if batch is not None:
            if len(batch) == 0:
                return None
            self._rows += len(batch)
        return batch

    def state_dict(self) -> dict:
        """The position after the last row returned (JSON-serialisable dict); its
        ``skipped`` (reason -> count, NOTE [bad records]) are the counts at that position."""
        return {"format": self.format_name, "rows": self._rows, "skipped": dict(self._skipped()), **self._get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Move to ``state`` (from ``state_dict()`` of a source over the same data).

        Raises:
            DataError: ``state`` is malformed or belongs to another format.
        """
        if not isinstance(state, dict) or state.get("format") != self.format_name:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise DataError(
                f"state is for format {got!r}, this source is {self.format_name!r}; "
                "pass the state saved from the same source"
            )
        rows = state.get("rows")
        if not isinstance(rows, int) or rows < 0:
            raise DataError(f"malformed state: 'rows' must be an int >= 0, got {rows!r}")
        self._set_state(state)
        self._rows = rows

    def close(self, timeout_s: float = 5.0) -> None:
        """Release files; idempotent. A source that waits to close (Kafka's group leave) waits
        at most ``timeout_s`` (docs/design.md, "Timeouts and units")."""
        self._closed = True

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        """Batches of up to 65,536 rows until the end of data (convenience)."""
        while True:
            batch = self.read(65536)
            if batch is None:
                return
            yield batch

    # ----------------------------------------------------------------- hooks
    def _skipped(self) -> dict:
        return {}

    def _seek(self, rows: int) -> bool:
        """From the start, move past the first ``rows`` rows without reading them, where that
        costs nothing and skips no bad record (:class:`herald.loader.splits.RowRange`
        reaches its start so); False where the rows must be read (the default)."""
        return False

    def _read(self, max_rows: int) -> SampleBatch | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _get_state(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def _set_state(self, state: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class MemorySource(Source):
    """The rows of one in-memory :class:`SampleBatch` as a source, in order (reads are
    views); position = row index. Subclasses decode a whole file at open and serve it from
    memory (:class:`herald.loader.formats.raw.MovieLensSource`)."""

    format_name = "memory"

    def __init__(self, batch: SampleBatch):
        super().__init__()
        self._all, self._pos = batch, 0

    @property
    def schema(self) -> Schema:
        return self._all.schema

    @property
    def num_rows(self) -> int:
        return len(self._all)

    def _read(self, max_rows: int) -> SampleBatch | None:
        if self._pos >= len(self._all):
            return None
        out = self._all.slice(self._pos, self._pos + max_rows)
        self._pos += len(out)
        return out

    def _get_state(self) -> dict:
        return {"row": self._pos}

    def _set_state(self, state: dict) -> None:
        row = state_int(state, "row")
        if row > len(self._all):
            raise DataError(f"malformed state: row {row} is past the end ({len(self._all)} rows)")
        self._pos = row


def read_rows(source: Source, max_rows: int | None = None) -> SampleBatch | None:
    """The next ``max_rows`` rows of ``source`` (None: up to its end) as one batch, read
    65,536 at a time; None when it has no rows left."""
    parts, have = [], 0
    while max_rows is None or have < max_rows:
        b = source.read(65536 if max_rows is None else min(65536, max_rows - have))
        if b is None:
            break
        parts.append(b)
        have += len(b)
    return SampleBatch.concat(parts) if parts else None


def state_int(state: dict, key: str, minimum: int = 0) -> int:
    """``state[key]`` as an int >= ``minimum``; raises DataError naming the key otherwise."""
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DataError(f"malformed state: {key!r} must be an int >= {minimum}, got {value!r}")
    return value
