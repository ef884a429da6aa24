"""Record formats of the text sources: column layouts and decoding to SampleBatch.

A format turns records (lines without their newline) held in one byte buffer into
per-record columns with :mod:`herald.loader.kernels`, then builds a
:class:`SampleBatch` from the good records. File sources
(:mod:`herald.loader.formats.text`) and :func:`herald.loader.formats.decode.decode_records`
(Kafka messages) share this code.

Layouts (NOTE [id hash] for hashed tables; table salt = table index):

- ``criteo``: ``label \\t I1..I13 \\t C1..C26``. Label "0"/"1". Dense ``I_k``: empty
  -> 0, else ``log(1 + max(x, 0))`` (negative counts are clamped to 0). Tables
  ``C1..C26``: the raw field bytes are hashed; an empty field gives no id (length 0).
- ``avazu``: ``id,click,hour,C1,banner_pos,...,C21`` (24 columns). ``id`` is not a
  feature; label = ``click``; the other 22 columns (``hour`` included, as a raw
  categorical value) are hashed tables; no dense features.
- ``movielens``: ``user,item,rating,timestamp`` separated by ``,`` (ratings.csv) or
  ``\\t`` (u.data); tables ``user`` and ``item`` use the raw ids; rating and
  timestamp are auxiliary columns (the source sorts and labels with them). The side
  tables (genres, history, ml-100k user attributes) come from other files: NOTE
  [movielens side features] in :mod:`herald.loader.formats.movielens_side`.
- ``libfm``: ``label idx:val ...``; see :class:`LibfmFormat`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from herald.hashing import table_seed
from herald.loader import kernels as K
from herald.loader.batch import KEY_DTYPE, OFFSET_DTYPE, SampleBatch, Schema

AVAZU_COLUMNS = (
    "id",
    "click",
    "hour",
    "C1",
    "banner_pos",
    "site_id",
    "site_domain",
    "site_category",
    "app_id",
    "app_domain",
    "app_category",
    "device_id",
    "device_ip",
    "device_model",
    "device_type",
    "device_conn_type",
    "C14",
    "C15",
    "C16",
    "C17",
    "C18",
    "C19",
    "C20",
    "C21",
)


def _jagged(ids_t: np.ndarray, has_t: np.ndarray | None, arange: np.ndarray):
    """(values uint64 [nnz], offsets int64 [n+1]) of one table from per-record ids."""
    if has_t is None or has_t.all():
        return np.ascontiguousarray(ids_t), arange
    mask = has_t.view(bool)
    offsets = np.empty(mask.shape[0] + 1, OFFSET_DTYPE)
    offsets[0] = 0
    np.cumsum(mask, out=offsets[1:])
    return ids_t[mask], offsets


@dataclasses.dataclass
class Decoded:
    """Per-record columns of ``n`` decoded records (bad ones included).

    ``status`` int8 [n] (NOTE [record status]); ``labels`` float32 [n]; ``dense``
    float32 [n, D]; ``ids`` uint64 [T, n]; ``has`` uint8 [T, n] or None (all present);
    ``aux`` float64 [A, n].
    """

    status: np.ndarray
    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    has: np.ndarray | None
    aux: np.ndarray
    table_names: tuple[str, ...]

    def batch(self, rows: np.ndarray | None = None) -> SampleBatch:
        """SampleBatch of the records at ``rows`` (int64 [m], default: all good ones)."""
        if rows is None:
            rows = np.flatnonzero(self.status == K.OK)
        m = rows.shape[0]
        arange = np.arange(m + 1, dtype=OFFSET_DTYPE)
        values, offsets = [], []
        for t in range(self.ids.shape[0]):
            v, o = _jagged(self.ids[t, rows], None if self.has is None else self.has[t, rows], arange)
            values.append(v)
            offsets.append(o)
        return SampleBatch(self.labels[rows], self.dense[rows], values, offsets, self.table_names, validate=False)


class DelimitedFormat:
    """A separator-delimited record layout decoded by ``parse_delimited_jit``.

    Args:
        name: format name; sep: one-byte separator; kinds: one ``kernels.K_*`` per
        column; table_names: the tables, in the order of the ``K_HASH``/``K_UINT_ID``
        columns; dense_dim: number of ``K_DENSE_LOG`` columns; aux_dim: number of
        ``K_AUX_FLOAT`` columns; bucket_count: reduce hashed ids modulo this (0 = no).
    """

    def __init__(self, name: str, sep: bytes, kinds: list[int], table_names, *, bucket_count: int = 0):
        self.name = name
        self.sep = sep[0]
        self.kinds = np.asarray(kinds, np.int64)
        slots, counters = [], {}
        for k in kinds:
            group = {K.K_HASH: "t", K.K_UINT_ID: "t", K.K_DENSE_LOG: "d", K.K_AUX_FLOAT: "a"}.get(k, "-")
            slots.append(counters.get(group, 0))
            counters[group] = counters.get(group, 0) + 1
        self.slots = np.asarray(slots, np.int64)
        self.schema = Schema(tuple(table_names), counters.get("d", 0))
        self.aux_dim = counters.get("a", 0)
        if counters.get("t", 0) != len(self.schema.table_names):
            raise ValueError(f"{name}: {counters.get('t', 0)} id columns but {len(table_names)} table names")
        self.seeds = np.array([table_seed(t) for t in range(self.schema.num_tables)], np.uint64)
        self.bucket_count = np.uint64(bucket_count)
        self.all_present = K.K_HASH not in kinds

    def decode(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Decoded:
        """Decode records ``buf[starts[r]:ends[r]]`` (uint8 buffer, int64 [n] bounds)."""
        n = starts.shape[0]
        t = self.schema.num_tables
        labels = np.zeros(n, np.float32)
        dense = np.zeros((n, self.schema.dense_dim), np.float32)
        ids = np.zeros((t, n), KEY_DTYPE)
        has = np.ones((t, n), np.uint8)
        aux = np.zeros((self.aux_dim, n), np.float64)
        status = np.zeros(n, np.int8)
        K.parse_delimited_jit(
            buf,
            starts,
            ends,
            self.sep,
            self.kinds,
            self.slots,
            self.seeds,
            self.bucket_count,
            labels,
            dense,
            ids,
            has,
            aux,
            status,
        )
        return Decoded(status, labels, dense, ids, None if self.all_present else has, aux, self.schema.table_names)


class LibfmFormat:
    """libFM records with one active index per field, decoded by ``parse_libfm_jit``.

    Field boundaries: every Frappe line lists exactly ``num_fields`` features in field
    order (checked on the real files: indices sorted, field ``k`` is token ``k``, the
    per-field index ranges are disjoint), so token ``k`` goes to table ``k`` and the
    raw index is the id (uint64, not hashed). A line with another number of features
    is a ``field_count`` error.
    """

    FRAPPE_FIELDS = (
        "user",
        "item",
        "daytime",
        "weekday",
        "isweekend",
        "homework",
        "cost",
        "weather",
        "country",
        "city",
    )

    def __init__(self, table_names=FRAPPE_FIELDS):
        self.name = "libfm"
        self.schema = Schema(tuple(table_names), 0)

    def decode(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Decoded:
        n = starts.shape[0]
        labels = np.zeros(n, np.float32)
        ids = np.zeros((self.schema.num_tables, n), KEY_DTYPE)
        status = np.zeros(n, np.int8)
        K.parse_libfm_jit(buf, starts, ends, labels, ids, status)
        return Decoded(
            status, labels, np.zeros((n, 0), np.float32), ids, None, np.zeros((0, n)), self.schema.table_names
        )


def criteo_format(bucket_count: int = 0) -> DelimitedFormat:
    """Criteo TSV: label, I1..I13, C1..C26 (see module docstring)."""
    kinds = [K.K_LABEL01] + [K.K_DENSE_LOG] * 13 + [K.K_HASH] * 26
    return DelimitedFormat("criteo", b"\t", kinds, [f"C{i}" for i in range(1, 27)], bucket_count=bucket_count)


def avazu_format(bucket_count: int = 0) -> DelimitedFormat:
    """Avazu CSV without header: id (ignored), click (label), 22 hashed tables."""
    kinds = [K.K_SKIP, K.K_LABEL01] + [K.K_HASH] * 22
    return DelimitedFormat("avazu", b",", kinds, AVAZU_COLUMNS[2:], bucket_count=bucket_count)


def movielens_format(sep: bytes) -> DelimitedFormat:
    """MovieLens ratings: user, item (raw ids), rating, timestamp (aux 0 and 1)."""
    kinds = [K.K_UINT_ID, K.K_UINT_ID, K.K_AUX_FLOAT, K.K_AUX_FLOAT]
    return DelimitedFormat("movielens", sep, kinds, ("user", "item"))


def split_lines(buf: np.ndarray, final: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Record bounds in ``buf`` (uint8): (starts int64 [n], ends int64 [n], consumed bytes).

    Records end at ``\\n``; the bytes after the last ``\\n`` are a record only when
    ``final`` (end of file) and non-empty, otherwise they are left unconsumed.
    """
    nl = np.flatnonzero(buf == 10)
    starts = np.empty(nl.shape[0] + 1, np.int64)
    starts[0] = 0
    starts[1:] = nl + 1
    ends = np.empty_like(starts)
    ends[:-1] = nl
    ends[-1] = buf.shape[0]
    if final and starts[-1] < buf.shape[0]:
        return starts, ends, buf.shape[0]
    return starts[:-1], ends[:-1], int(starts[-1])
