"""Decoding of individual text records (one Kafka message = one raw line).

Shares the parsers of the file sources (:mod:`herald.loader.formats.layouts`).
"""

from __future__ import annotations

import numpy as np

from herald.errors import ConfigError, DataError
from herald.loader.batch import SampleBatch
from herald.loader.formats import layouts as formats
from herald.loader.formats.layouts import Decoded
from herald.loader.kernels import REASONS
from herald.loader.policy import POLICIES

_FORMATS = {"criteo": formats.criteo_format, "avazu": formats.avazu_format}
_CACHE: dict = {}


def decode_lines(format: str, records: list[bytes], *, bucket_count: int = 0) -> Decoded:
    """Per-record columns and status of raw lines, bad ones included (no policy applied).

    For callers that need each bad record's index (e.g. to report Kafka offsets):
    ``decoded.status`` is int8 [len(records)] (NOTE [record status]),
    ``decoded.batch(rows)`` builds the SampleBatch of chosen good rows. Line clean-up
    as :func:`decode_records`. ``None`` records are treated as empty lines.

    Raises:
        ConfigError: unknown format.
    """
    if format not in _FORMATS:
        raise ConfigError(f"decode_records supports formats {sorted(_FORMATS)}, got {format!r}")
    key = (format, bucket_count)
    fmt = _CACHE.get(key) or _CACHE.setdefault(key, _FORMATS[format](bucket_count))
    clean = [
        b"" if r is None else r[:-2] if r.endswith(b"\r\n") else r[:-1] if r.endswith(b"\n") else r for r in records
    ]
    lengths = np.fromiter((len(r) for r in clean), np.int64, len(clean))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    buf = np.frombuffer(b"".join(clean), np.uint8) if clean else np.zeros(0, np.uint8)
    decoded = fmt.decode(buf, starts, ends)
    inner_nl = [i for i, r in enumerate(clean) if b"\n" in r]
    if inner_nl:
        decoded.status[inner_nl] = REASONS.index("field_count")
    return decoded


def decode_records(
    format: str,
    records: list[bytes],
    *,
    policy: str = "strict",
    source_name: str = "records",
    first_position: int = 0,
    bucket_count: int = 0,
) -> tuple[SampleBatch, dict[str, int], list[bytes]]:
    """Decode header-less ``criteo`` or ``avazu`` lines into one SampleBatch.

    Args:
        format: ``"criteo"`` or ``"avazu"``.
        records: one raw line per item (a trailing ``\\n`` or ``\\r\\n`` is removed;
            a record with an inner newline is a ``field_count`` error).
        policy: ``"strict"`` (raise on the first bad record) or ``"skip"``.
        source_name: named in errors (e.g. ``"topic/partition"``).
        first_position: position (e.g. Kafka offset) of ``records[0]``; record ``i`` is
            reported at ``first_position + i``.
        bucket_count: reduce hashed ids modulo this (0 = full 64-bit ids).

    Returns:
        (batch of the good records in order, skipped counts reason -> n,
        the raw bad records in order).

    Raises:
        DataError: under ``strict``, naming source, position and reason.
        ConfigError: unknown format or policy.
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
    decoded = decode_lines(format, records, bucket_count=bucket_count)
    bad = np.flatnonzero(decoded.status)
    if bad.size and policy == "strict":
        reason = REASONS[decoded.status[bad[0]]]
        raise DataError(
            f"bad {format} record: {reason}; fix the producer or decode with policy='skip'",
            source=source_name,
            position=first_position + int(bad[0]),
            reason=reason,
        )
    skipped: dict[str, int] = {}
    for code in decoded.status[bad]:
        skipped[REASONS[code]] = skipped.get(REASONS[code], 0) + 1
    return decoded.batch(), skipped, [records[i] for i in bad]
