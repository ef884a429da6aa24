"""Line-oriented file sources (Criteo TSV, Avazu CSV, libFM) read in byte chunks.

The file is read ``chunk_bytes`` at a time; complete lines of a chunk are decoded in
one kernel call (:mod:`herald.loader.formats.layouts`) and served by ``read``. Position =
(byte offset of the next unread line, number of lines consumed); resume seeks to the
offset. Bad records follow NOTE [bad records] in :mod:`herald.loader.policy`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np

from herald.config import require
from herald.errors import DataError
from herald.loader.batch import SampleBatch, Schema
from herald.loader.formats.layouts import split_lines
from herald.loader.policy import BadRecordLog, BadRecordSettings
from herald.loader.source import Source, state_int


@dataclasses.dataclass(frozen=True)
class TextSettings:
    """Args: chunk_bytes: bytes read per decode step (a longer line grows the chunk)."""

    chunk_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        require(self.chunk_bytes >= 1, f"chunk_bytes must be >= 1, got {self.chunk_bytes}")


class _Chunk:
    """Decoded lines of one chunk and the cursor over its good lines."""

    def __init__(self, base: int, first_line: int, buf, starts, ends, consumed, decoded, strict):
        self.base, self.first_line, self.buf = base, first_line, buf
        self.starts, self.ends, self.decoded = starts, ends, decoded
        self.next_start = np.empty_like(starts)
        self.next_start[:-1] = starts[1:]
        if starts.shape[0]:
            self.next_start[-1] = consumed
        self.consumed = consumed
        status = decoded.status
        self.good = np.flatnonzero(status == 0)
        self.error_line = None
        if strict:
            bad = np.flatnonzero(status != 0)
            if bad.size:
                self.error_line = int(bad[0])
                self.good = self.good[self.good < bad[0]]
        self.gp = 0  # next good row (index into self.good)
        self.line_ptr = 0  # next line not yet passed

    def raw(self, lines: np.ndarray) -> list[bytes]:
        return [self.buf[self.starts[k] : self.ends[k]].tobytes() for k in lines]


class TextFileSource(Source):
    """A source over one line-oriented file.

    Args:
        path: the file; fmt: a format with ``schema`` and ``decode(buf, starts, ends)``;
        bad: the bad-record policy; text: chunk settings; header: predicate on the
        first line's bytes; when true that line is a header, not a record.

    Raises:
        DataError: the file cannot be opened; bad records under ``strict``.
    """

    def __init__(
        self,
        path,
        fmt,
        *,
        bad: BadRecordSettings = BadRecordSettings(),
        text: TextSettings = TextSettings(),
        header: Callable[[bytes], bool] | None = None,
    ):
        super().__init__()
        self.format_name = fmt.name
        self.path = os.fspath(path)
        self._fmt = fmt
        self._text = text
        try:
            self._file = open(self.path, "rb")
        except OSError as exc:
            raise DataError(f"cannot open {self.path}: {exc}; check the path", source=self.path) from exc
        self._log = BadRecordLog(bad, self.path)
        self._offset = 0
        self._line = 0
        self._chunk: _Chunk | None = None
        self._eof = False
        self._header_bytes = 0
        if header is not None:
            first = self._file.readline()
            if first and header(first.rstrip(b"\r\n")):
                self._header_bytes = len(first)
                self._offset, self._line = len(first), 1

    @property
    def schema(self) -> Schema:
        return self._fmt.schema

    @property
    def stats(self) -> dict:
        return {**super().stats, "lines": self._line, "path": self.path}

    def _skipped(self) -> dict:
        return self._log.skipped

    # ----------------------------------------------------------------- reading
    def _load_chunk(self) -> bool:
        """Decode the lines after ``self._offset``; False at end of file."""
        self._file.seek(self._offset)
        want = self._text.chunk_bytes
        data = self._file.read(want)
        final = len(data) < want
        while not final and b"\n" not in data:
            more = self._file.read(want)
            final = len(more) < want
            data += more
        if not data:
            return False

        buf = np.frombuffer(data, np.uint8)
        starts, ends, consumed = split_lines(buf, final)
        decoded = self._fmt.decode(buf, starts, ends)
        self._chunk = _Chunk(self._offset, self._line, buf, starts, ends, consumed, decoded, self._log.strict)
        return True

    def _advance(self, chunk: _Chunk, line_ptr: int) -> None:
        """Pass lines ``[chunk.line_ptr, line_ptr)``: count/quarantine bad ones, move position."""
        if line_ptr <= chunk.line_ptr:
            return
        status = chunk.decoded.status[chunk.line_ptr : line_ptr]
        if not self._log.strict:
            bad = np.flatnonzero(status) + chunk.line_ptr
            if bad.size:
                raw = chunk.raw(bad) if self._log.settings.quarantine_path else ()
                self._log.record(status, raw)
        chunk.line_ptr = line_ptr
        self._offset = chunk.base + int(chunk.next_start[line_ptr - 1])
        self._line = chunk.first_line + line_ptr

    def _read(self, max_rows: int) -> SampleBatch | None:
        while True:
            chunk = self._chunk
            if chunk is not None and chunk.gp < chunk.good.shape[0]:
                idx = chunk.good[chunk.gp : chunk.gp + max_rows]
                chunk.gp += idx.shape[0]
                self._advance(chunk, int(idx[-1]) + 1)
                return chunk.decoded.batch(idx)
            if chunk is not None:
                if chunk.error_line is not None:
                    self._advance(chunk, chunk.error_line)
                    code = int(chunk.decoded.status[chunk.error_line])
                    raise self._log.error(code, chunk.first_line + chunk.error_line + 1)
                self._advance(chunk, chunk.starts.shape[0])
                self._offset = chunk.base + chunk.consumed
                self._chunk = None
            if self._eof or not self._load_chunk():
                self._eof = True
                return None

    # ------------------------------------------------------------------- state
    def _get_state(self) -> dict:
        return {
            "path": os.path.basename(self.path),
            "offset": self._offset,
            "line": self._line,
            "skipped": dict(self._log.skipped),
        }

    def _set_state(self, state: dict) -> None:
        offset = state_int(state, "offset")
        line = state_int(state, "line")
        if state.get("path") != os.path.basename(self.path):
            raise DataError(
                f"state is for file {state.get('path')!r}, this source reads "
                f"{os.path.basename(self.path)!r}; pass the state of the same file"
            )
        if offset > os.fstat(self._file.fileno()).st_size:
            raise DataError(f"malformed state: offset {offset} is past the end of {self.path}")
        self._log.load(state.get("skipped", {}))
        self._offset, self._line = max(offset, self._header_bytes), line
        self._chunk, self._eof = None, False

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._closed:
            self._file.close()
            self._log.close()
        super().close(timeout_s)
