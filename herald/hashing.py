"""Stable 64-bit ids for categorical values.

NOTE [id hash]: a raw categorical value (the bytes of a string field) becomes an
id as

    h = FNV-1a-64 over the field's bytes, starting from
        offset_basis XOR splitmix64(table_salt)
    id = splitmix64(h)                      (uint64)
    id = id mod bucket_count                (only if the table has a bucket count)

with ``offset_basis = 0xcbf29ce484222325``, ``prime = 0x100000001b3`` and
``splitmix64(x)`` the finaliser of Steele et al. (``x += 0x9e3779b97f4a7c15``;
``x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9``; ``x = (x ^ (x >> 27)) *
0x94d049bb133111eb``; ``x ^= x >> 31``), all modulo 2**64. ``table_salt`` is
the table's index in the schema, so equal strings in different tables get
different ids. The value is the same on every platform, process and run, and
is never truncated to 32 bits. An empty field has no id (the sample has no
value in that table), it is not hashed.

Integer-valued categorical fields that a source documents as ids (MovieLens
user and movie ids, libFM feature indices) are used as they are, not hashed.
"""

from __future__ import annotations

import numba as nb
import numpy as np

FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
_MASK = (1 << 64) - 1


@nb.njit(nb.uint64(nb.uint64), cache=True, nogil=True)
def splitmix64_jit(x):
    x = x + nb.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> nb.uint64(30))) * nb.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> nb.uint64(27))) * nb.uint64(0x94D049BB133111EB)
    return x ^ (x >> nb.uint64(31))


@nb.njit(cache=True, nogil=True)
def hash_field_jit(buf, start, end, seed):
    """Hash ``buf[start:end]`` (uint8 array) with ``seed = FNV_OFFSET ^ splitmix64(salt)``."""
    h = seed
    for i in range(start, end):
        h = (h ^ nb.uint64(buf[i])) * nb.uint64(0x100000001B3)
    return splitmix64_jit(h)


@nb.njit(cache=True, nogil=True)
def hash_fields_jit(buf, starts, ends, seed, bucket_count, out):
    """Hash fields ``buf[starts[i]:ends[i]]`` into ``out[i]`` (uint64); ``bucket_count`` 0 = none."""
    for i in range(starts.shape[0]):
        h = hash_field_jit(buf, starts[i], ends[i], seed)
        if bucket_count > 0:
            h = h % nb.uint64(bucket_count)
        out[i] = h
    return out


def splitmix64(x: int) -> int:
    """splitmix64 of a Python int in ``[0, 2**64)`` (the reference of :func:`splitmix64_jit`)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def table_seed(table_salt: int) -> np.uint64:
    """The FNV starting state for table ``table_salt`` (see NOTE [id hash])."""
    return np.uint64(int(FNV_OFFSET) ^ splitmix64(int(table_salt) & _MASK))


def hash_value(value: str | bytes, table_salt: int = 0, bucket_count: int = 0) -> int:
    """The id of one categorical value (pure Python; the reference for the kernels).

    Args:
        value: the raw field, ``str`` (encoded as UTF-8) or ``bytes``.
        table_salt: the table's index in the schema.
        bucket_count: reduce modulo this many buckets; 0 keeps all 64 bits.

    Returns:
        int in ``[0, 2**64)`` (or ``[0, bucket_count)``).

    >>> hash_value("68fd1e64", 0) == hash_value(b"68fd1e64", 0)
    True
    >>> hash_value("68fd1e64", 0) != hash_value("68fd1e64", 1)
    True
    """
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    h = int(table_seed(table_salt))
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    h = splitmix64(h)
    return h % bucket_count if bucket_count > 0 else h


def hash_strings(values, table_salt: int = 0, bucket_count: int = 0) -> np.ndarray:
    """Ids of many values (a sequence of ``str``/``bytes``) as uint64 [n], via the kernel."""
    encoded = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    buf = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    out = np.empty(len(encoded), dtype=np.uint64)
    return hash_fields_jit(buf, starts, ends, table_seed(table_salt), np.uint64(bucket_count), out)
