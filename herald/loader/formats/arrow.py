"""SampleBatch <-> Arrow, shared by Parquet files and the Kafka source.

Column layout (NOTE [arrow layout]):

    label    float32                          [B]
    dense    fixed_size_list<float32>[D]      [B]     (omitted when D = 0)
    <table>  uint64, nullable                 [B]     single-hot table: null = no id
    <table>  list<uint64>                     [B]     multi-hot table

The schema metadata key ``herald.schema`` holds JSON
``{"version": 1, "label": "label", "dense": "dense" | [names] | null,
"tables": [{"name": ..., "column": ..., "kind": "single" | "multi"}, ...]}``;
it maps columns to label/dense/tables and is what ``herald convert`` stores in
Parquet files. Without it, :func:`infer_layout` uses: ``label`` column as label, a
``dense`` fixed-size-list column or every other floating column as dense, every
integer or list-of-integer column as a table. Conversion is zero-copy where Arrow
allows it (no nulls, no slicing of a list column); no per-row Python.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from herald.errors import DataError
from herald.loader.batch import KEY_DTYPE, OFFSET_DTYPE, SampleBatch
from herald.loader.kernels import compact_jit

META_KEY = b"herald.schema"


def layout_of(batch_schema, multi_hot=frozenset()) -> dict:
    """The ``herald.schema`` JSON object for a herald Schema (dense as one column)."""
    return {
        "version": 1,
        "label": "label",
        "dense": "dense" if batch_schema.dense_dim else None,
        "tables": [
            {"name": n, "column": n, "kind": "multi" if n in multi_hot else "single"} for n in batch_schema.table_names
        ],
    }


def arrow_schema(batch_schema, multi_hot=frozenset(), extra_metadata: dict | None = None) -> pa.Schema:
    """The Arrow schema (NOTE [arrow layout]) of a herald Schema."""
    fields = [pa.field("label", pa.float32(), nullable=False)]
    if batch_schema.dense_dim:
        fields.append(pa.field("dense", pa.list_(pa.float32(), batch_schema.dense_dim), nullable=False))
    for n in batch_schema.table_names:
        fields.append(pa.field(n, pa.list_(pa.uint64()) if n in multi_hot else pa.uint64()))
    meta = {META_KEY: json.dumps(layout_of(batch_schema, multi_hot)).encode()}
    for k, v in (extra_metadata or {}).items():
        meta[k.encode() if isinstance(k, str) else k] = v.encode() if isinstance(v, str) else v
    return pa.schema(fields, metadata=meta)


def batch_to_arrow(batch: SampleBatch, multi_hot=frozenset(), schema: pa.Schema | None = None) -> pa.RecordBatch:
    """A RecordBatch in NOTE [arrow layout] with the herald schema metadata.

    Args:
        batch: B samples. multi_hot: names of tables stored as ``list<uint64>``; a table
            not listed must have at most one id per sample (else it is stored as a list
            too). schema: an Arrow schema from :func:`arrow_schema` to reuse.
    """
    lengths = [np.diff(o) for o in batch.offsets]
    multi = set(multi_hot) | {n for n, ln in zip(batch.table_names, lengths) if ln.size and ln.max() > 1}
    if schema is None or any(not pa.types.is_list(schema.field(n).type) for n in multi if n in schema.names):
        schema = arrow_schema(batch.schema, frozenset(multi))
    b = len(batch)
    arrays = [pa.array(batch.labels, pa.float32())]
    if batch.dense_dim:
        flat = pa.array(np.ascontiguousarray(batch.dense).reshape(-1), pa.float32())
        arrays.append(pa.FixedSizeListArray.from_arrays(flat, batch.dense_dim))
    for name, v, o, ln in zip(batch.table_names, batch.values, batch.offsets, lengths):
        if pa.types.is_list(schema.field(name).type):
            arrays.append(pa.ListArray.from_arrays(pa.array(o.astype(np.int32)), pa.array(v, pa.uint64())))
        elif v.shape[0] == b:
            arrays.append(pa.array(v, pa.uint64()))
        else:
            full = np.zeros(b, KEY_DTYPE)
            present = ln.astype(bool)
            full[present] = v
            arrays.append(pa.array(full, pa.uint64(), mask=~present))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def infer_layout(schema: pa.Schema, where: str = "") -> dict:
    """The herald layout of an Arrow schema: from its metadata, else by column types.

    Args:
        schema: the Arrow schema; where: the file (or stream) it belongs to, named in errors.

    Raises:
        DataError: malformed metadata, no ``label`` column, or (without metadata) a column
            of a type herald cannot map (:func:`check_layout` names the fix).
    """
    at = f"{where}: " if where else ""
    meta = schema.metadata or {}
    if META_KEY in meta:
        try:
            layout = json.loads(meta[META_KEY])
            [(t["name"], t["column"]) for t in layout["tables"]]
            layout["label"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(
                f"{at}malformed {META_KEY.decode()} metadata: {exc}; rewrite the file with herald convert"
            ) from exc
        check_layout(schema, layout, where)
        return layout
    if "label" not in schema.names:
        raise DataError(
            f"{at}no 'label' column and no herald.schema metadata; write the file with "
            f"herald convert (columns: {schema.names})"
        )
    dense, tables, unmapped = [], [], []
    for f in schema:
        t = f.type
        if f.name == "label":
            continue
        if pa.types.is_fixed_size_list(t) and f.name == "dense":
            dense = "dense"
        elif pa.types.is_floating(t) and isinstance(dense, list):
            dense.append(f.name)
        elif pa.types.is_integer(t):
            tables.append({"name": f.name, "column": f.name, "kind": "single"})
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
            tables.append({"name": f.name, "column": f.name, "kind": "multi"})
        else:
            unmapped.append(f"{f.name!r} ({t})")
    if unmapped:
        raise DataError(
            f"{at}column(s) {', '.join(unmapped)} map to nothing herald reads (label: a float or "
            "integer column; dense: float columns or a fixed_size_list<float32> 'dense'; tables: "
            "integer or list<integer> id columns); drop them, cast them, or write the file with "
            "herald convert"
        )
    layout = {"version": 1, "label": "label", "dense": dense or None, "tables": tables}
    check_layout(schema, layout, where)
    return layout


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)


def check_layout(schema: pa.Schema, layout: dict, where: str = "") -> None:
    """Check that ``schema`` holds every column ``layout`` maps, with a type herald reads.

    Label: a float, integer or bool column. Dense: a ``fixed_size_list`` of numbers or
    number columns. Tables: at least one; integer ids (>= 0, uint64 kept as is) or
    lists of integers. Values are checked per sample when read (NOTE [value checks]).

    Raises:
        DataError: naming ``where`` (the file), the column and the fix.
    """
    at = f"{where}: " if where else ""

    def field(column: str, role: str) -> pa.Field:
        if column not in schema.names:
            raise DataError(
                f"{at}the {role} column {column!r} named by the herald layout is missing (columns: "
                f"{schema.names}); rewrite the file with herald convert"
            )
        return schema.field(column)

    label = field(layout["label"], "label")
    if not _numeric(label.type):
        raise DataError(
            f"{at}column {label.name!r} is {label.type}: label must be a float or integer column "
            "(0/1 or a probability); cast it to float32, or write the file from the raw data with "
            "herald convert"
        )
    spec = layout.get("dense")
    for column in [spec] if isinstance(spec, str) else list(spec or []):
        f = field(column, "dense")
        ok = (
            (pa.types.is_fixed_size_list(f.type) and _numeric(f.type.value_type))
            if isinstance(spec, str)
            else _numeric(f.type)
        )
        if not ok:
            want = "a fixed_size_list<float32>" if isinstance(spec, str) else "a float column"
            raise DataError(
                f"{at}column {column!r} is {f.type}: dense features must be {want}; cast it, or "
                "write the file from the raw data with herald convert"
            )
    if not layout["tables"]:
        raise DataError(
            f"{at}no table column: herald needs at least one id column (integer, e.g. uint64, or "
            f"list<integer>) beside the label and dense features (columns: {schema.names}); write the "
            "file with herald convert"
        )
    for t in layout["tables"]:
        f = field(t["column"], "table")
        ty = f.type
        ok = pa.types.is_integer(ty) or (
            (pa.types.is_list(ty) or pa.types.is_large_list(ty)) and pa.types.is_integer(ty.value_type)
        )
        if not ok:
            raise DataError(
                f"{at}table column {t['column']!r} is {ty}: ids must be integers (uint64) or lists of "
                "integers; hash categorical strings to ids (herald convert does, from a text format) "
                "or cast the column"
            )


def _column(data, name: str) -> pa.Array:
    col = data.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def _ids(arr: pa.Array) -> np.ndarray:
    """uint64 numpy view of an integer array's values (bits reinterpreted for int64)."""
    if arr.type == pa.uint64() or arr.type == pa.int64():
        out = np.frombuffer(arr.buffers()[1], np.uint64, len(arr), arr.offset * 8)
        return out
    if not pa.types.is_integer(arr.type):
        raise DataError(f"table column of type {arr.type}: expected integers; rewrite with herald convert")
    vals = (
        arr.to_numpy(zero_copy_only=False)
        if arr.null_count == 0
        else np.frombuffer(arr.buffers()[1], arr.type.to_pandas_dtype(), len(arr), arr.offset)
    )
    if np.issubdtype(vals.dtype, np.signedinteger) and vals.size and vals.min() < 0:
        raise DataError("negative id in a table column; ids must be >= 0 (or stored as int64 bits)")
    return vals.astype(KEY_DTYPE)


def _table(arr: pa.Array, arange: np.ndarray):
    b = len(arr)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        if arr.null_count:
            arr = arr.fill_null(pa.scalar([], arr.type))
        offs = np.frombuffer(
            arr.buffers()[1],
            np.int32 if pa.types.is_list(arr.type) else np.int64,
            b + 1,
            arr.offset * (4 if pa.types.is_list(arr.type) else 8),
        )
        start, stop = int(offs[0]), int(offs[-1])
        values = _ids(arr.values.slice(start, stop - start))
        return np.ascontiguousarray(values), (offs - start).astype(OFFSET_DTYPE)
    vals = _ids(arr)
    if arr.null_count == 0:
        return vals, arange
    bits = np.frombuffer(arr.buffers()[0], np.uint8)
    valid = np.unpackbits(bits, count=arr.offset + b, bitorder="little")[arr.offset :]
    values = np.empty(b, KEY_DTYPE)
    offsets = np.empty(b + 1, OFFSET_DTYPE)
    return values[: compact_jit(vals, valid, values, offsets)], offsets


def arrow_to_batch(data, layout: dict | None = None) -> SampleBatch:
    """A SampleBatch from a ``pa.RecordBatch`` or ``pa.Table`` in NOTE [arrow layout].

    Args:
        data: Arrow columns; layout: as :func:`infer_layout` (default: from ``data.schema``).

    Raises:
        DataError: a mapped column is missing or has an unsupported type. Values are
            not checked here (NOTE [value checks]: :mod:`herald.loader.validation`).
    """
    layout = layout or infer_layout(data.schema)
    b = data.num_rows
    try:
        labels = _column(data, layout["label"]).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        dense_spec = layout.get("dense")
        if isinstance(dense_spec, str):
            col = _column(data, dense_spec)
            d = col.type.list_size
            dense = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(b, d)
        elif dense_spec:
            dense = np.stack([_column(data, c).to_numpy(zero_copy_only=False) for c in dense_spec], axis=1).astype(
                np.float32
            )
        else:
            dense = np.zeros((b, 0), np.float32)
        arange = np.arange(b + 1, dtype=OFFSET_DTYPE)
        values, offsets, names = [], [], []
        for t in layout["tables"]:
            try:
                v, o = _table(_column(data, t["column"]), arange)
            except DataError as exc:
                raise DataError(f"table column {t['column']!r}: {exc}") from exc
            values.append(v)
            offsets.append(o)
            names.append(t["name"])
    except KeyError as exc:
        raise DataError(
            f"column {exc} named by the herald layout is missing; rewrite the file with herald convert"
        ) from exc
    return SampleBatch(labels, dense, values, offsets, names, validate=False)
