"""``herald convert`` (any source -> Parquet) and ``herald datagen`` (synthetic -> Parquet).

Files are written in NOTE [arrow layout] (:mod:`herald.loader.formats.arrow`) with the
``herald.schema`` metadata, row groups of ``row_group_rows`` rows, Snappy
compression and a CRC32 checksum in every page header (``WRITER_OPTIONS``, the one
home of the writer's options), which :class:`herald.loader.formats.parquet.ParquetSource`
verifies on read. ``datagen`` also stores ``herald.synthetic`` (spec JSON) and
``herald.seed``; reading the file back gives exactly the rows that
``SyntheticSource(spec, rows=N, seed=S)`` streams.
"""

from __future__ import annotations

import os
import pathlib
import types

import pyarrow.parquet as pq

from herald.config import require
from herald.loader.formats.arrow import arrow_schema, batch_to_arrow
from herald.loader.source import Source
from herald.loader.registry import open_source
from herald.loader.synthetic import SyntheticSource, fit_spec, preset_spec

DEFAULT_ROW_GROUP_ROWS = 131072
# Every Parquet file herald writes: Snappy pages, each with a CRC32 of its bytes so a page
# changed after writing (disk, copy) is a bad record on read, not silently altered ids.
WRITER_OPTIONS = types.MappingProxyType({"compression": "snappy", "write_page_checksum": True})


def write_parquet(source: Source, dst, *, row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
                  extra_metadata: dict | None = None, progress: bool = True, desc: str = "convert") -> dict:
    """Write every row of ``source`` to the Parquet file ``dst`` (with ``WRITER_OPTIONS``:
    page checksums).

    Args:
        source: any Source (read to its end); dst: the output file (parents are created);
        row_group_rows: rows per row group (>= 1); extra_metadata: str -> str schema
        metadata; progress: show a tqdm bar (rows; total when ``source.num_rows`` is known).

    Returns:
        ``{"rows": n, "path": dst, "source": source.stats}``.

    Raises:
        ConfigError: bad ``row_group_rows``; DataError: from the source.
    """
    from tqdm import tqdm

    require(row_group_rows >= 1, f"row_group_rows must be >= 1, got {row_group_rows}")
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    schema = arrow_schema(source.schema, source.multi_hot_tables, extra_metadata)
    tmp = dst.with_name(dst.name + ".tmp")
    n = 0
    with tqdm(total=source.num_rows, unit="rows", unit_scale=True, desc=desc, disable=not progress) as bar, \
            pq.ParquetWriter(tmp, schema, **WRITER_OPTIONS) as writer:
        while True:
            batch = source.read(row_group_rows)
            if batch is None:
                break
            writer.write_batch(batch_to_arrow(batch, source.multi_hot_tables, schema),
                               row_group_size=row_group_rows)
            n += len(batch)
            bar.update(len(batch))
    os.replace(tmp, dst)
    return {"rows": n, "path": str(dst), "source": source.stats}


def convert(src, dst, *, format: str | None = None, row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
            progress: bool = True, **options) -> dict:
    """``herald convert SRC DST.parquet``: open ``src`` with ``open_source(src, format, **options)``
    and write it with :func:`write_parquet`."""
    with open_source(src, format=format, **options) as source:
        return write_parquet(source, dst, row_group_rows=row_group_rows, progress=progress,
                             desc=f"convert {os.path.basename(os.fspath(src))}")


def datagen(out, *, rows: int, seed: int = 0, fit: str | None = None, preset: str | None = None,
            fit_rows: int = 1_000_000, row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
            progress: bool = True) -> dict:
    """``herald datagen``: write ``rows`` synthetic samples to ``out``.

    Args:
        out: ``*.parquet`` file, or a directory (then ``out/part-00000.parquet``);
        rows: >= 0; seed: int; fit: real data file to fit the spec to (any format
        ``open_source`` reads) or preset: ``criteo-kaggle`` (default when neither).

    Raises:
        ConfigError: both ``fit`` and ``preset``, or bad values.
    """
    require(not (fit and preset), "give either fit or preset, not both")
    if fit:
        with open_source(fit) as real:
            spec = fit_spec(real, fit_rows)
    else:
        spec = preset_spec(preset or "criteo-kaggle")
    out = pathlib.Path(out)
    dst = out if out.suffix == ".parquet" else out / "part-00000.parquet"
    source = SyntheticSource(spec, rows=rows, seed=seed)
    meta = {"herald.synthetic": spec.to_json(), "herald.seed": str(int(seed))}
    return write_parquet(source, dst, row_group_rows=row_group_rows, extra_metadata=meta,
                         progress=progress, desc="datagen")
