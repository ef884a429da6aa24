"""Numba kernels of the loader: text-record parsing and synthetic sample generation.

Pure functions over preallocated arrays. Python code in
:mod:`herald.loader.formats.layouts` and :mod:`herald.loader.synthetic` validates,
allocates and orchestrates. Every kernel is ``nogil`` so the prefetch thread of
:class:`herald.loader.batcher.GlobalBatcher` runs it beside the consumer.

NOTE [record status]: parsers write one status code per record (line); 0 is a
good record, any other value is the reason it is bad. The names are in
``REASONS`` (index = code) and are the keys of a source's ``stats["skipped"]``.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from herald.hashing import hash_field_jit, splitmix64_jit

# NOTE [record status] codes.
OK = 0
EMPTY_LINE = 1
BAD_UTF8 = 2
FIELD_COUNT = 3
BAD_INT = 4
OVERFLOW = 5
BAD_FLOAT = 6
BAD_LABEL = 7
MISSING_ID = 8
BAD_DENSE = 9  # a dense value not finite or beyond DENSE_LIMIT (NOTE [value checks], herald/loader/validation.py)
BAD_CHECKSUM = 10  # its Parquet row group has a page whose CRC does not match (herald/loader/formats/parquet.py)
REASONS = (
    "ok",
    "empty_line",
    "bad_utf8",
    "field_count",
    "bad_int",
    "overflow",
    "bad_float",
    "bad_label",
    "missing_id",
    "bad_dense",
    "bad_checksum",
)

# Column kinds of parse_delimited_jit.
K_SKIP = 0  # ignored column (e.g. Avazu ``id``)
K_LABEL01 = 1  # label, exactly "0" or "1"
K_DENSE_LOG = 2  # signed int64, empty -> 0, value log(1 + max(x, 0))
K_HASH = 3  # categorical bytes hashed per NOTE [id hash]; empty -> no id
K_UINT_ID = 4  # decimal uint64 id used as is; empty -> missing_id
K_AUX_FLOAT = 5  # float64 auxiliary value (MovieLens rating, timestamp)

_U64_MAX = np.uint64(0xFFFFFFFFFFFFFFFF)
_I64_MAX = 9223372036854775807


@nb.njit(cache=True, nogil=True, inline="always")
def utf8_valid_jit(buf, s, e):
    """True when ``buf[s:e]`` (uint8) is valid UTF-8 (no overlong forms or surrogates)."""
    i = s
    while i < e:
        c = buf[i]
        if c < 0x80:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            n = 1
        elif 0xE0 <= c <= 0xEF:
            n = 2
        elif 0xF0 <= c <= 0xF4:
            n = 3
        else:
            return False
        if i + n >= e:
            return False
        for k in range(1, n + 1):
            if (buf[i + k] & 0xC0) != 0x80:
                return False
        c1 = buf[i + 1]
        if (
            (c == 0xE0 and c1 < 0xA0)
            or (c == 0xED and c1 >= 0xA0)
            or (c == 0xF0 and c1 < 0x90)
            or (c == 0xF4 and c1 >= 0x90)
        ):
            return False
        i += n + 1
    return True


@nb.njit(cache=True, nogil=True, inline="always")
def parse_int64_jit(buf, s, e):
    """Signed decimal in ``buf[s:e]`` -> (int64 value, status); empty is BAD_INT."""
    i = s
    neg = False
    if i < e and (buf[i] == 45 or buf[i] == 43):
        neg = buf[i] == 45
        i += 1
    if i >= e:
        return 0, BAD_INT
    v = 0
    while i < e:
        d = np.int64(buf[i]) - 48
        if d < 0 or d > 9:
            return 0, BAD_INT
        if v > (_I64_MAX - d) // 10:
            return 0, OVERFLOW
        v = v * 10 + d
        i += 1
    return (-v if neg else v), OK


@nb.njit(cache=True, nogil=True, inline="always")
def parse_uint64_jit(buf, s, e):
    """Unsigned decimal in ``buf[s:e]`` -> (uint64 value, status); empty is MISSING_ID."""
    if s >= e:
        return nb.uint64(0), MISSING_ID
    v = nb.uint64(0)
    ten = nb.uint64(10)
    for i in range(s, e):
        c = buf[i]
        if c < 48 or c > 57:
            return nb.uint64(0), BAD_INT
        d = nb.uint64(c - 48)
        if v > (_U64_MAX - d) // ten:
            return nb.uint64(0), OVERFLOW
        v = v * ten + d
    return v, OK


@nb.njit(cache=True, nogil=True, inline="always")
def parse_float_jit(buf, s, e):
    """Decimal float ``[+-]d*[.d*][(e|E)[+-]d+]`` -> (float64, status). No nan/inf."""
    i = s
    neg = False
    if i < e and (buf[i] == 45 or buf[i] == 43):
        neg = buf[i] == 45
        i += 1
    mant = 0.0
    nd = 0
    exp10 = 0
    while i < e and 48 <= buf[i] <= 57:
        if nd < 18:
            mant = mant * 10.0 + (buf[i] - 48)
        else:
            exp10 += 1
        nd += 1
        i += 1
    if i < e and buf[i] == 46:
        i += 1
        while i < e and 48 <= buf[i] <= 57:
            if nd < 18:
                mant = mant * 10.0 + (buf[i] - 48)
                exp10 -= 1
            nd += 1
            i += 1
    if nd == 0:
        return 0.0, BAD_FLOAT
    if i < e and (buf[i] == 101 or buf[i] == 69):
        i += 1
        eneg = False
        if i < e and (buf[i] == 45 or buf[i] == 43):
            eneg = buf[i] == 45
            i += 1
        if i >= e:
            return 0.0, BAD_FLOAT
        ex = 0
        while i < e and 48 <= buf[i] <= 57:
            if ex < 100000:
                ex = ex * 10 + (buf[i] - 48)
            i += 1
        exp10 += -ex if eneg else ex
    if i != e:
        return 0.0, BAD_FLOAT
    if exp10 < 0:
        v = mant / 10.0 ** (-exp10) if exp10 > -300 else 0.0
    else:
        v = mant * 10.0**exp10 if exp10 < 400 else math.inf
    if not math.isfinite(v):
        return 0.0, OVERFLOW
    return (-v if neg else v), OK


@nb.njit(cache=True, nogil=True, inline="always")
def _record_jit(buf, s, e):
    """(end without a trailing ``\\r``, status) of the record ``buf[s:e]``: ``EMPTY_LINE``,
    ``BAD_UTF8`` or ``OK`` (NOTE [record status])."""
    if e > s and buf[e - 1] == 13:
        e -= 1
    if e == s:
        return e, EMPTY_LINE
    if not utf8_valid_jit(buf, s, e):
        return e, BAD_UTF8
    return e, OK


@nb.njit(cache=True, nogil=True, inline="always")
def _field(buf, fs, fe, r, kind, slot, seeds, bucket_count, labels, dense, ids, has, aux):
    """Decode one field of record ``r`` into its output slot; returns a status code."""
    if kind == K_SKIP:
        return OK
    if kind == K_HASH:
        if fe > fs:
            h = hash_field_jit(buf, fs, fe, seeds[slot])
            if bucket_count > 0:
                h = h % bucket_count
            ids[slot, r] = h
            has[slot, r] = 1
        else:
            has[slot, r] = 0
        return OK
    if kind == K_DENSE_LOG:
        if fe == fs:
            dense[r, slot] = 0.0
            return OK
        v, st = parse_int64_jit(buf, fs, fe)
        if st != OK:
            return st
        dense[r, slot] = np.float32(math.log1p(max(v, 0)))
        return OK
    if kind == K_LABEL01:
        if fe - fs == 1 and (buf[fs] == 48 or buf[fs] == 49):
            labels[r] = np.float32(buf[fs] - 48)
            return OK
        return BAD_LABEL
    if kind == K_UINT_ID:
        u, st = parse_uint64_jit(buf, fs, fe)
        if st != OK:
            return st
        ids[slot, r] = u
        has[slot, r] = 1
        return OK
    # K_AUX_FLOAT
    f, st = parse_float_jit(buf, fs, fe)
    if st != OK:
        return st
    aux[slot, r] = f
    return OK


@nb.njit(cache=True, nogil=True)
def parse_delimited_jit(
    buf, starts, ends, sep, kinds, slots, seeds, bucket_count, labels, dense, ids, has, aux, status
):
    """Parse ``n`` delimited records (Criteo TSV, Avazu CSV, MovieLens).

    Args:
        buf: uint8 [nbytes]; record ``r`` is ``buf[starts[r]:ends[r]]`` (int64 [n]),
            without its newline (a trailing ``\\r`` is dropped here).
        sep: the separator byte; kinds, slots: int64 [C] kind (``K_*``) and output
            slot (table, dense or aux index) of each of the ``C`` columns.
        seeds: uint64 [T] NOTE [id hash] seed per table; bucket_count: uint64, 0 = none.
        labels: float32 [n]; dense: float32 [n, D]; ids: uint64 [T, n];
        has: uint8 [T, n] (1 = the record has an id in that table);
        aux: float64 [A, n]; status: int8 [n], NOTE [record status].
    """
    ncol = kinds.shape[0]
    for r in range(starts.shape[0]):
        s = starts[r]
        e, st = _record_jit(buf, s, ends[r])
        if st != OK:
            status[r] = st
            continue
        nf = 1
        for i in range(s, e):
            if buf[i] == sep:
                nf += 1
        if nf != ncol:
            status[r] = FIELD_COUNT
            continue
        st = OK
        col = 0
        fs = s
        for i in range(s, e + 1):
            if i == e or buf[i] == sep:
                kind = kinds[col]
                slot = slots[col]
                if kind == K_HASH:  # the common case, kept out of _field
                    if i > fs:
                        h = hash_field_jit(buf, fs, i, seeds[slot])
                        if bucket_count > 0:
                            h = h % bucket_count
                        ids[slot, r] = h
                        has[slot, r] = 1
                    else:
                        has[slot, r] = 0
                elif kind == K_DENSE_LOG:
                    if i > fs:
                        v, st = parse_int64_jit(buf, fs, i)
                        if st != OK:
                            break
                        dense[r, slot] = np.float32(math.log1p(max(v, 0)))
                    else:
                        dense[r, slot] = 0.0
                elif kind != K_SKIP:
                    st = _field(buf, fs, i, r, kind, slot, seeds, bucket_count, labels, dense, ids, has, aux)
                    if st != OK:
                        break
                col += 1
                fs = i + 1
        status[r] = st


@nb.njit(cache=True, nogil=True)
def parse_libfm_jit(buf, starts, ends, labels, ids, status):
    """Parse ``n`` libFM records ``label idx:val idx:val ...`` with ``F`` features each.

    Token ``k`` (after the label) is field ``k``'s id (``idx`` as uint64); ``val`` must
    be a float and is otherwise ignored (one-hot data). Label ``1``/``+1`` -> 1,
    ``-1``/``0`` -> 0. Tokens are separated by runs of spaces or tabs.

    Args: as :func:`parse_delimited_jit`; labels: float32 [n]; ids: uint64 [F, n].
    """
    nfield = ids.shape[0]
    for r in range(starts.shape[0]):
        s = starts[r]
        e, st = _record_jit(buf, s, ends[r])
        if st != OK:
            status[r] = st
            continue
        st = OK
        tok = -1
        i = s
        while i < e and st == OK:
            while i < e and (buf[i] == 32 or buf[i] == 9):
                i += 1
            if i >= e:
                break
            ts = i
            colon = -1
            while i < e and buf[i] != 32 and buf[i] != 9:
                if buf[i] == 58 and colon < 0:
                    colon = i
                i += 1
            if tok == -1:
                lab, lst = parse_int64_jit(buf, ts, i)
                if lst != OK or not (lab == 1 or lab == -1 or lab == 0):
                    st = BAD_LABEL
                else:
                    labels[r] = np.float32(1.0 if lab == 1 else 0.0)
            elif tok >= nfield:
                st = FIELD_COUNT
            elif colon < 0:
                st = BAD_INT
            else:
                u, ust = parse_uint64_jit(buf, ts, colon)
                if ust == MISSING_ID:
                    ust = BAD_INT
                if ust != OK:
                    st = ust
                else:
                    _, fst = parse_float_jit(buf, colon + 1, i)
                    st = fst
                    ids[tok, r] = u
            tok += 1
        if st == OK and tok != nfield:
            st = FIELD_COUNT if tok >= 0 else EMPTY_LINE
        status[r] = st


@nb.njit(cache=True, nogil=True)
def _uniform(h):
    """uint64 -> float64 in [0, 1) from the top 53 bits."""
    return np.float64(h >> nb.uint64(11)) * (1.0 / 9007199254740992.0)


@nb.njit(cache=True, nogil=True)
def compact_jit(ids, has, values, offsets):
    """Jagged form of one table: ``values`` uint64 [nnz] gets ``ids[i]`` where ``has[i]``,
    ``offsets`` int64 [n+1] the running count. Returns nnz."""
    k = 0
    offsets[0] = 0
    for i in range(ids.shape[0]):
        if has[i]:
            values[k] = ids[i]
            k += 1
        offsets[i + 1] = k
    return k


# one function: the row loop keeps its RNG state and per-table cursors in registers (a split
# through helpers returning state costs that, as in docs/scheduler.md "Speed")
@nb.njit(cache=True, nogil=True)
def synthetic_jit(
    seed,
    start,
    cards,
    pl_scale,
    pl_power,
    missing,
    key_seeds,
    table_weights,
    dense_mean,
    dense_std,
    dense_weights,
    bias,
    labels,
    dense,
    ids,
    has,
):
    """Generate samples ``start .. start+n-1``: each is a function of (seed, row) only.

    NOTE [synthetic sample]: row ``i`` draws its random numbers from the counter
    ``u_j = splitmix64(splitmix64(seed ^ splitmix64(i)) + j)``. Table ``t`` is empty
    with probability ``missing[t]``, otherwise it picks rank ``k`` in
    ``[0, cards[t])`` from a truncated power law ``P(k) ~ (k+1)^-alpha_t``
    by the inverse CDF of the continuous law, ``x = (pl_scale[t] * u + 1) ** pl_power[t]``
    with ``pl_scale = (cards+1)^(1-alpha) - 1`` and ``pl_power = 1/(1-alpha)``
    (``pl_power = 0`` marks ``alpha = 1``: ``x = (cards+1)^u``, ``pl_scale = log(cards+1)``),
    and emits the key ``splitmix64(k ^ key_seeds[t])`` (stable, looks like a hashed
    id). Dense features come in pairs of one Box-Muller draw: ``z`` standard normal,
    value ``max(dense_mean[d] + dense_std[d] * z, 0)``. Label:
    Bernoulli(sigmoid(bias + sum_d dense_weights[d] * z_d + sum_t table_weights[t] *
    effect(key))) with ``effect`` in [-1, 1) derived from the key bits, so labels
    depend on features (a model can learn them; AUC > 0.5).

    Args:
        seed: uint64; start: int64 first row; cards: int64 [T]; pl_scale, pl_power,
        missing, table_weights: float64 [T]; key_seeds: uint64 [T]; dense_mean,
        dense_std, dense_weights: float64 [D]; bias: float64; outputs labels float32 [n],
        dense float32 [n, D], ids uint64 [T, n], has uint8 [T, n].
    """
    n = labels.shape[0]
    ntab = cards.shape[0]
    nd = dense_mean.shape[0]
    for r in range(n):
        base = splitmix64_jit(seed ^ splitmix64_jit(nb.uint64(start + r)))
        logit = bias
        j = 0
        for d in range(0, nd, 2):
            u1 = _uniform(splitmix64_jit(base + nb.uint64(j)))
            u2 = _uniform(splitmix64_jit(base + nb.uint64(j + 1)))
            j += 2
            rad = math.sqrt(-2.0 * math.log(1.0 - u1))
            z = rad * math.cos(2.0 * math.pi * u2)
            dense[r, d] = np.float32(max(dense_mean[d] + dense_std[d] * z, 0.0))
            logit += dense_weights[d] * z
            if d + 1 < nd:
                z = rad * math.sin(2.0 * math.pi * u2)
                dense[r, d + 1] = np.float32(max(dense_mean[d + 1] + dense_std[d + 1] * z, 0.0))
                logit += dense_weights[d + 1] * z
        for t in range(ntab):
            if missing[t] > 0.0:
                if _uniform(splitmix64_jit(base + nb.uint64(j))) < missing[t]:
                    has[t, r] = 0
                    j += 2
                    continue
            u = _uniform(splitmix64_jit(base + nb.uint64(j + 1)))
            j += 2
            if pl_power[t] == 0.0:
                x = math.exp(u * pl_scale[t])
            else:
                x = (pl_scale[t] * u + 1.0) ** pl_power[t]
            k = min(max(np.int64(x), 1), cards[t]) - 1
            key = splitmix64_jit(nb.uint64(k) ^ key_seeds[t])
            ids[t, r] = key
            has[t, r] = 1
            if table_weights[t] != 0.0:
                logit += table_weights[t] * (2.0 * _uniform(splitmix64_jit(key)) - 1.0)
        ul = _uniform(splitmix64_jit(base + nb.uint64(j)))
        labels[r] = np.float32(1.0 if ul < 1.0 / (1.0 + math.exp(-logit)) else 0.0)
