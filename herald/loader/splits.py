"""Train / evaluation splits of a file source (the global batches of the training split
come from :class:`herald.loader.global_batches.GlobalBatches`).

The held-out split is the *last* ``eval_fraction`` of the source's rows: for the
time-ordered sources (MovieLens by timestamp, Criteo and Avazu by log order) the
model is evaluated on later interactions than it was trained on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from herald import keymap
from herald.errors import ConfigError, DataError
from herald.loader.batch import SampleBatch
from herald.loader.registry import open_source
from herald.loader.source import Source, state_int


class RowRange(Source):
    """Rows ``[start, stop)`` of another source (``stop=None``: to the end).

    Rows before ``start`` are read and discarded once, when reading begins (or passed
    without reading where the source can: ``Source._seek``, the synthetic one). The skipped
    counts (``stats["skipped"]``, NOTE [bad records]) are this range's own: the bad records
    the inner source passed before ``start`` belong to the rows before it.
    """

    format_name = "row_range"

    def __init__(self, inner: Source, start: int = 0, stop: int | None = None):
        super().__init__()
        if start < 0 or (stop is not None and stop < start):
            raise ConfigError(f"row range [{start}, {stop}) is empty or negative")
        self.inner, self.start, self.stop = inner, start, stop
        self._pos = 0  # rows of ``inner`` consumed
        # the inner source's skipped counts once it reached ``start`` (None: not yet there)
        self._before: dict | None = {} if start == 0 else None

    @property
    def schema(self):
        return self.inner.schema

    @property
    def num_rows(self) -> int | None:
        n = self.inner.num_rows
        end = n if self.stop is None else (self.stop if n is None else min(n, self.stop))
        return None if end is None else max(0, end - self.start)

    @property
    def stats(self) -> dict:
        return {**self.inner.stats, **super().stats}

    def lag(self) -> dict | None:
        return self.inner.lag()

    def _skipped(self) -> dict:
        if self._before is None:
            return {}
        inner = self.inner.stats["skipped"]
        out = {k: v - self._before.get(k, 0) for k, v in inner.items()}
        return {k: v for k, v in out.items() if v}

    def _read(self, max_rows: int) -> SampleBatch | None:
        if 0 == self._pos < self.start and self.inner._seek(self.start):
            self._pos = self.start
        while self._pos < self.start:
            skipped = self.inner.read(min(65536, self.start - self._pos))
            if skipped is None:
                return None
            self._pos += len(skipped)
        if self._before is None:
            self._before = dict(self.inner.stats["skipped"])
        if self.stop is not None:
            max_rows = min(max_rows, self.stop - self._pos)
            if max_rows <= 0:
                return None
        batch = self.inner.read(max_rows)
        if batch is not None:
            self._pos += len(batch)
        return batch

    def _get_state(self) -> dict:
        return {"pos": self._pos, "inner": self.inner.state_dict(), "skipped_before": self._before}

    def _set_state(self, state: dict) -> None:
        self._pos = state_int(state, "pos")
        before = state.get("skipped_before", {} if self.start == 0 else None)
        if before is not None and not (
            isinstance(before, dict) and all(isinstance(k, str) and isinstance(v, int) for k, v in before.items())
        ):
            raise DataError(f"malformed row range state: 'skipped_before' must map reason -> count, got {before!r}")
        self.inner.load_state_dict(state.get("inner"))
        self._before = before

    def close(self, timeout_s: float = 5.0) -> None:
        self.inner.close(timeout_s)
        super().close(timeout_s)


def _total_rows(spec: str, options: dict[str, Any]) -> int:
    with open_source(spec, **options) as src:
        if src.num_rows is not None:
            return int(src.num_rows)
        return sum(len(b) for b in src)


def _without_quarantine(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != "quarantine_path"}


def source_schema(spec: str, options: dict[str, Any]):
    """The :class:`~herald.loader.batch.Schema` of ``spec``: the source is opened and
    closed, with no pass over its rows (what the settings that need the schema are
    checked against before the row count of :func:`open_train_eval`); never quarantines."""
    with open_source(spec, **_without_quarantine(options)) as src:
        return src.schema


def open_train_eval(spec: str, eval_fraction: float, options: dict[str, Any]):
    """``(train source, eval source or None, info)`` for ``spec``.

    ``info`` has ``total_rows``, ``train_rows`` and ``eval_rows``: good rows (bad
    records skipped under ``bad_records="skip"`` are not rows).

    The row count is a pass over the whole input (unless the source knows its rows
    without decoding), and it is the only pass that writes ``options["quarantine_path"]``:
    the file is emptied first and receives every bad record of the input exactly once
    (a resumed job rewrites the same content). The training and evaluation sources,
    which may read records several times (epochs, the rows before the held-out split),
    never quarantine.

    Raises:
        ConfigError: the source has too few rows for the split.
    """
    quarantine = options.get("quarantine_path")
    if quarantine is not None and options.get("bad_records") == "skip":
        open(quarantine, "wb").close()
    total = _total_rows(spec, options)
    options = _without_quarantine(options)
    n_eval = int(round(total * eval_fraction))
    n_train = total - n_eval
    if n_train <= 0:
        raise ConfigError(f"{spec}: {total} rows leave nothing to train on with --eval-fraction {eval_fraction}")
    train = RowRange(open_source(spec, **options), 0, n_train)
    ev = RowRange(open_source(spec, **options), n_train) if n_eval else None
    return train, ev, {"total_rows": total, "train_rows": n_train, "eval_rows": n_eval}


def distinct_keys_per_table(spec: str, options: dict[str, Any], rows: int) -> list[int]:
    """Distinct ids of each table in the first ``rows`` rows (a pre-pass: never quarantines)."""
    with RowRange(open_source(spec, **_without_quarantine(options)), 0, rows) as src:
        return distinct_ids_per_table(src)


def distinct_ids_per_table(batches) -> list[int]:
    """Distinct ids of each table in an iterable of :class:`SampleBatch` (a pre-pass).

    Returns:
        one count per table, in table order.

    The keys go into one ``(table, id)`` key map (NOTE [key map] in herald/keymap.py, the
    scheduler's kernel and dtypes), so memory stays bounded by the distinct keys and each
    value costs one hash probe (1.2M synthetic Criteo rows: 0.5 s, against 2.4 s for
    repeated ``np.unique`` of the accumulated ids).
    """
    capacity, tables = 1 << 16, 0
    ids, tab = np.zeros(capacity, np.uint64), np.zeros(capacity, np.int16)
    buckets, used = keymap.new_buckets(capacity, ids, tab, 0), np.zeros(1, np.int64)
    for b in batches:
        tables = max(tables, b.num_tables)
        values = tuple(np.ascontiguousarray(v, dtype=np.uint64) for v in b.values)
        nnz = sum(v.shape[0] for v in values)
        if used[0] + nnz > capacity:  # room for every key of the batch: one kernel call inserts them all
            capacity = max(2 * capacity, int(used[0]) + nnz)
            ids, tab = np.resize(ids, capacity), np.resize(tab, capacity)
            buckets = keymap.new_buckets(capacity, ids, tab, int(used[0]))
        keymap.find_or_insert_tables_jit(buckets, ids, tab, used, values, np.empty(nnz, np.int32))
    return np.bincount(tab[: used[0]], minlength=tables).astype(int).tolist()


def count_distinct_keys(batches) -> int:
    """Distinct ``(table, id)`` keys in a sequence of SampleBatch (a pre-pass for ``cache_ratio``)."""
    return sum(distinct_ids_per_table(batches))
