"""Bad-record policy: ``strict`` raises, ``skip`` counts per reason and may quarantine.

NOTE [bad records]: a record is bad when its decoder gives a non-zero status
(NOTE [record status] in :mod:`herald.loader.kernels`), or, for columnar data
(Parquet, Arrow records from Kafka), when its label or dense values fail NOTE
[value checks] (:mod:`herald.loader.validation`: ``bad_label``, ``bad_dense``), or,
for Parquet, when its row group holds a page that fails its checksum (NOTE [page
checksums] in :mod:`herald.loader.formats.parquet`: ``bad_checksum``, the file and
row group named, one quarantine line per row group).
Under ``strict`` the source first returns every good record before the bad one,
then raises :class:`DataError` naming the file, the 1-based line (Parquet: the
0-based row of the file) and the reason. Under ``skip`` the record is dropped,
``stats["skipped"][reason]`` grows by one and, with a quarantine path, the raw
record is appended to that file, one per line (text formats: the line's bytes;
Parquet: a JSON object with file, row, reason, label and dense values). Counting
happens when the source's position passes the record, so counts restored by
``load_state_dict`` match an uninterrupted run; every source state carries them
(``state["skipped"]``).

A job reads its input several times (row count, distinct keys, epochs, the rows
before the held-out split): :func:`herald.loader.splits.open_train_eval` lets only
its row-count pass quarantine (after emptying the file), so the quarantine holds
each bad record once; :class:`herald.loader.global_batches.GlobalBatches` counts
each once however many epochs pass it, and ``herald train`` reports the counts per
split (docs/operations.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from herald.config import require
from herald.errors import DataError
from herald.loader.kernels import REASONS

POLICIES = ("strict", "skip")


@dataclasses.dataclass(frozen=True)
class BadRecordSettings:
    """Args: bad_records: ``"strict"`` or ``"skip"``; quarantine_path: file that
    receives the raw bad records (``skip`` only), or None."""

    bad_records: str = "strict"
    quarantine_path: str | None = None

    def __post_init__(self) -> None:
        require(self.bad_records in POLICIES, f"bad_records must be one of {POLICIES}, got {self.bad_records!r}")
        require(
            self.quarantine_path is None or self.bad_records == "skip",
            "quarantine_path needs bad_records='skip' (strict raises on the first bad record)",
        )


class BadRecordLog:
    """Applies :class:`BadRecordSettings` for one source: counts, quarantine, errors."""

    def __init__(self, settings: BadRecordSettings, source_name: str):
        self.settings = settings
        self.source_name = source_name
        self.skipped: dict[str, int] = {}
        self._quarantine = None

    @property
    def strict(self) -> bool:
        return self.settings.bad_records == "strict"

    def error(
        self, code: int, position: int, unit: str = "line", *, source: str | None = None, detail: str = ""
    ) -> DataError:
        """The strict policy's error for the record at ``position`` (``unit`` names what
        ``position`` counts, e.g. ``"line"`` or ``"row (0-based) {position} of FILE"`` with the
        position in it; ``source`` overrides the source name, e.g. one file of a directory;
        ``detail`` says what is wrong with the record)."""
        reason = REASONS[code]
        at = unit.format(position=position) if "{position}" in unit else f"{unit} {position}"
        return DataError(
            f"bad record at {at}: {reason}{': ' + detail if detail else ''}; fix the input, or drop "
            "and count bad records with bad_records='skip' (herald train --source-option bad_records=skip)",
            source=source or self.source_name,
            position=position,
            reason=reason,
        )

    def record(self, codes: np.ndarray, raw: Iterable[bytes] = ()) -> None:
        """Count bad records (int8 status codes [k], zeros ignored) and quarantine ``raw``."""
        codes = codes[codes != 0]
        if codes.size:
            for code, count in enumerate(np.bincount(codes.astype(np.int64))):
                if count:
                    self.skipped[REASONS[code]] = self.skipped.get(REASONS[code], 0) + int(count)
        if self.settings.quarantine_path is not None:
            lines = list(raw)
            if lines:
                if self._quarantine is None:
                    self._quarantine = open(self.settings.quarantine_path, "ab")
                self._quarantine.write(b"".join(line + b"\n" for line in lines))
                self._quarantine.flush()

    def load(self, skipped: dict) -> None:
        if not isinstance(skipped, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in skipped.items()
        ):
            raise DataError(f"malformed state: 'skipped' must map reason -> count, got {skipped!r}")
        self.skipped = dict(skipped)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the quarantine file; returns at once (``timeout_s``: nothing here waits)."""
        if self._quarantine is not None:
            self._quarantine.close()
            self._quarantine = None
