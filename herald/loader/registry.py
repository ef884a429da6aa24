"""``open_source``: a Source from a path or URL, and the extensible format registry.

Format inference from ``spec`` (override with ``format=``):

    scheme://...            the format registered under ``scheme`` (``synthetic``,
                            ``kafka`` once its module registers it)
    *.tsv                   criteo
    *.csv                   movielens if the header starts ``userId,movieId``, else avazu
    u.data                  movielens
    *.libfm                 libfm
    *.parquet or a folder   parquet

Synthetic URLs: ``synthetic://PRESET?rows=N&seed=S`` with PRESET ``criteo`` (alias
``criteo-kaggle``), or ``synthetic://fit?path=FILE&rows=N&seed=S[&fit_rows=M]`` to fit
the spec to a real file. Query keys: ``rows`` (default 1,000,000), ``seed`` (0),
``path`` and ``fit_rows`` (1,000,000). Keyword options override query keys.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable

from herald.config import split_options
from herald.errors import ConfigError
from herald.loader.formats.parquet import ParquetSettings, ParquetSource
from herald.loader.formats.raw import AvazuSource, CriteoSource, LibfmSource, MovieLensSettings, MovieLensSource
from herald.loader.formats.text import TextSettings
from herald.loader.policy import BadRecordSettings
from herald.loader.source import Source
from herald.loader.synthetic import SyntheticSource, fit_spec, preset_spec

_REGISTRY: dict[str, Callable[..., Source]] = {}


def register_format(name: str, factory: Callable[..., Source]) -> None:
    """Register ``factory(spec, **options) -> Source`` for ``format=name`` and ``name://`` URLs.

    A factory must raise ConfigError for unknown options (see :func:`split_options`).
    """
    _REGISTRY[name] = factory


def formats() -> list[str]:
    """Registered format names."""
    return sorted(_REGISTRY)


def _text(cls, name, extra=()):
    def factory(spec, **options):
        bad, text, rest = split_options(options, BadRecordSettings, TextSettings, extra=extra, where=name)
        return cls(spec, bad=bad, text=text, **rest)

    return factory


def _movielens(spec, **options):
    settings, bad, _ = split_options(options, MovieLensSettings, BadRecordSettings, where="movielens")
    return MovieLensSource(spec, settings=settings, bad=bad)


def _parquet(spec, **options):
    settings, bad, _ = split_options(options, ParquetSettings, BadRecordSettings, where="parquet")
    return ParquetSource(spec, settings=settings, bad=bad)


def _synthetic(spec, **options):
    url = urllib.parse.urlparse(spec) if "://" in spec else urllib.parse.urlparse("synthetic://criteo")
    query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
    query.update(options)
    (known,) = split_options(query, extra=("rows", "seed", "path", "fit_rows"), where="synthetic")
    try:
        rows, seed = int(known.get("rows", 1_000_000)), int(known.get("seed", 0))
        fit_rows = int(known.get("fit_rows", 1_000_000))
    except ValueError as exc:
        raise ConfigError(f"synthetic: rows, seed and fit_rows must be integers ({exc})") from exc
    if url.netloc == "fit":
        if "path" not in known:
            raise ConfigError("synthetic://fit needs path=FILE (a real data file to fit)")
        with open_source(known["path"]) as real:
            spec_ = fit_spec(real, fit_rows)
    else:
        spec_ = preset_spec({"criteo": "criteo-kaggle"}.get(url.netloc, url.netloc))
    return SyntheticSource(spec_, rows=rows, seed=seed)


register_format("criteo", _text(CriteoSource, "criteo", ("bucket_count",)))
register_format("avazu", _text(AvazuSource, "avazu", ("bucket_count",)))
register_format("libfm", _text(LibfmSource, "libfm", ("table_names",)))
register_format("movielens", _movielens)
register_format("parquet", _parquet)
register_format("synthetic", _synthetic)


def _kafka(spec, **options) -> Source:
    # imported on use, so that kafka-python loads only for kafka:// sources
    from herald.loader.kafka.source import open_kafka

    return open_kafka(spec, **options)


register_format("kafka", _kafka)


def infer_format(spec: str) -> str:
    """The format name for ``spec`` (see the module docstring). Raises ConfigError."""
    if "://" in spec:
        return spec.split("://", 1)[0]
    base = os.path.basename(spec.rstrip("/"))
    if os.path.isdir(spec) or base.endswith(".parquet"):
        return "parquet"
    if base.endswith(".tsv"):
        return "criteo"
    if base == "u.data":
        return "movielens"
    if base.endswith(".libfm"):
        return "libfm"
    if base.endswith(".csv"):
        try:
            with open(spec, "rb") as f:
                head = f.read(64)
        except OSError:
            head = b""
        return "movielens" if head.startswith(b"userId,movieId") else "avazu"
    raise ConfigError(f"cannot infer the format of {spec!r}; pass format= one of {formats()}")


def open_source(spec, *, format: str | None = None, **options) -> Source:
    """Open a Source for ``spec`` (a path or a ``scheme://`` URL).

    Args:
        spec: path or URL; format: a registered format name (default: inferred);
        options: the format's settings, e.g. ``bad_records="skip"``,
            ``quarantine_path=...``, ``threshold=4.0``, ``side_features=True``,
            ``history_length=50`` (movielens: NOTE [movielens side features]),
            ``bucket_count=...`` (criteo, avazu), ``chunk_bytes=...`` (text formats).

    Raises:
        ConfigError: unknown format or option (the message lists the known ones).
        DataError: the input cannot be opened or read.
    """
    spec = os.fspath(spec)
    name = format or infer_format(spec)
    if name not in _REGISTRY:
        raise ConfigError(f"unknown format {name!r}; registered formats: {formats()}")
    return _REGISTRY[name](spec, **options)
