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
import tempfile
import types

import pyarrow.parquet as pq

from herald.config import require
from herald.errors import ConfigError
from herald.loader.formats.arrow import arrow_schema, batch_to_arrow
from herald.loader.registry import open_source
from herald.loader.source import Source
from herald.loader.synthetic import SyntheticSource, fit_spec, preset_spec

DEFAULT_ROW_GROUP_ROWS = 131072
# Every Parquet file herald writes: Snappy pages, each with a CRC32 of its bytes so a page
# changed after writing (disk, copy) is a bad record on read, not silently altered ids.
WRITER_OPTIONS = types.MappingProxyType({"compression": "snappy", "write_page_checksum": True})


def check_output(dst, inputs=(), *, force: bool = False, make_folder: bool = False) -> pathlib.Path:
    """Check that ``dst`` may be written (NOTE [no input destroyed]) and return it as a path.

    Args:
        dst: the output file. inputs: the paths (or URLs, skipped) the output is made from.
        force: overwrite an existing ``dst``. make_folder: create ``dst``'s own folder when
            missing (``herald datagen --out DIR``); its parent must exist.

    Raises:
        ConfigError: ``dst`` is (or is inside) an input, exists without ``force``, is a
            folder, or its folder is missing.
    """
    dst = pathlib.Path(dst)
    for src in inputs:
        if src is None or "://" in os.fspath(src):
            continue
        src = pathlib.Path(src)
        same = dst.resolve() == src.resolve() or (dst.exists() and src.exists() and os.path.samefile(dst, src))
        if same or (src.is_dir() and dst.resolve().is_relative_to(src.resolve())):
            raise ConfigError(
                f"the output {dst} is the input {src}: writing it would destroy the input; give another output path"
            )
    if dst.is_dir():
        raise ConfigError(f"the output {dst} is a folder; give a .parquet file path")
    if dst.exists() and not force:
        raise ConfigError(f"the output {dst} exists; pass --force to overwrite it, or give another path")
    folder = dst.parent
    if not folder.is_dir():
        if make_folder and folder.parent.is_dir():
            folder.mkdir()
        else:
            raise ConfigError(f"the output's folder {folder} does not exist; create it first")
    return dst


# NOTE [no input destroyed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# ``herald convert`` and ``herald datagen`` never write over what they read: an output that
# is an input (the same path, a hard or symbolic link to it, or a file inside an input
# folder) is refused before anything is opened; an existing output is replaced only with
# ``--force``; the rows go to a temporary file beside the output that is renamed over it
# once complete (removed if writing fails), so a failed or interrupted run leaves the old
# output as it was. Only the output's own folder is ever created (``datagen --out DIR``),
# never missing parents.
def write_parquet(
    source: Source,
    dst,
    *,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
    extra_metadata: dict | None = None,
    progress: bool = True,
    desc: str = "convert",
) -> dict:
    """Write every row of ``source`` to the Parquet file ``dst`` (with ``WRITER_OPTIONS``:
    page checksums) through a temporary file renamed over ``dst`` (NOTE [no input
    destroyed]; :func:`check_output` checks ``dst`` first).

    Args:
        source: any Source (read to its end); dst: the output file (its folder must exist);
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
    schema = arrow_schema(source.schema, source.multi_hot_tables, extra_metadata)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    n = 0
    try:
        with (
            tqdm(total=source.num_rows, unit="rows", unit_scale=True, desc=desc, disable=not progress) as bar,
            pq.ParquetWriter(tmp, schema, **WRITER_OPTIONS) as writer,
        ):
            while True:
                batch = source.read(row_group_rows)
                if batch is None:
                    break
                writer.write_batch(
                    batch_to_arrow(batch, source.multi_hot_tables, schema), row_group_size=row_group_rows
                )
                n += len(batch)
                bar.update(len(batch))
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, dst)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return {"rows": n, "path": str(dst), "source": source.stats}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def convert(
    src,
    dst,
    *,
    format: str | None = None,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
    progress: bool = True,
    force: bool = False,
    **options,
) -> dict:
    """``herald convert SRC DST.parquet``: open ``src`` with ``open_source(src, format, **options)``
    and write it with :func:`write_parquet`; ``dst`` is checked first (:func:`check_output`:
    never an input, overwritten only with ``force``)."""
    check_output(dst, [src, options.get("quarantine_path")], force=force)
    with open_source(src, format=format, **options) as source:
        return write_parquet(
            source,
            dst,
            row_group_rows=row_group_rows,
            progress=progress,
            desc=f"convert {os.path.basename(os.fspath(src))}",
        )


def datagen(
    out,
    *,
    rows: int,
    seed: int = 0,
    fit: str | None = None,
    preset: str | None = None,
    fit_rows: int = 1_000_000,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
    progress: bool = True,
    force: bool = False,
) -> dict:
    """``herald datagen``: write ``rows`` synthetic samples to ``out``.

    Args:
        out: ``*.parquet`` file, or a directory (then ``out/part-00000.parquet``);
        rows: >= 0; seed: int; fit: real data file to fit the spec to (any format
        ``open_source`` reads) or preset: ``criteo-kaggle`` (default when neither);
        force: overwrite an existing output (:func:`check_output`).

    Raises:
        ConfigError: both ``fit`` and ``preset``, bad values, or an output that may not
            be written (:func:`check_output`).
    """
    require(not (fit and preset), "give either fit or preset, not both")
    out = pathlib.Path(out)
    dst = check_output(
        out if out.suffix == ".parquet" else out / "part-00000.parquet",
        [fit],
        force=force,
        make_folder=out.suffix != ".parquet",
    )
    if fit:
        with open_source(fit) as real:
            spec = fit_spec(real, fit_rows)
    else:
        spec = preset_spec(preset or "criteo-kaggle")
    source = SyntheticSource(spec, rows=rows, seed=seed)
    meta = {"herald.synthetic": spec.to_json(), "herald.seed": str(int(seed))}
    return write_parquet(
        source, dst, row_group_rows=row_group_rows, extra_metadata=meta, progress=progress, desc="datagen"
    )
