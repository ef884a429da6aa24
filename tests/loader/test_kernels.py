"""Parsing kernels: numbers, overflow limits, UTF-8 validation, line splitting."""

import numpy as np
import pytest

from herald.loader import kernels as K
from herald.loader.formats.layouts import split_lines


def _b(s):
    return np.frombuffer(s, np.uint8)


@pytest.mark.parametrize(
    "text,value,status",
    [
        (b"0", 0, K.OK),
        (b"-17", -17, K.OK),
        (b"+5", 5, K.OK),
        (b"9223372036854775807", 2**63 - 1, K.OK),
        (b"9223372036854775808", 0, K.OVERFLOW),
        (b"", 0, K.BAD_INT),
        (b"-", 0, K.BAD_INT),
        (b"1x", 0, K.BAD_INT),
        (b"1.5", 0, K.BAD_INT),
    ],
)
def test_parse_int64(text, value, status):
    buf = _b(text)
    assert K.parse_int64_jit(buf, 0, len(buf)) == (value, status)


@pytest.mark.parametrize(
    "text,value,status",
    [
        (b"18446744073709551615", 2**64 - 1, K.OK),
        (b"18446744073709551616", 0, K.OVERFLOW),
        (b"", 0, K.MISSING_ID),
        (b"-1", 0, K.BAD_INT),
        (b"12a", 0, K.BAD_INT),
    ],
)
def test_parse_uint64(text, value, status):
    buf = _b(text)
    v, st = K.parse_uint64_jit(buf, 0, len(buf))
    assert (int(v), st) == (value, status)


@pytest.mark.parametrize("text", [b"4.5", b"0.5", b"3", b"-2.25", b"1e3", b"2.5E-2", b"964982703", b".5"])
def test_parse_float_exact(text):
    buf = _b(text)
    assert K.parse_float_jit(buf, 0, len(buf)) == (float(text), K.OK)


@pytest.mark.parametrize(
    "text,status",
    [
        (b"", K.BAD_FLOAT),
        (b"nan", K.BAD_FLOAT),
        (b"inf", K.BAD_FLOAT),
        (b"1e", K.BAD_FLOAT),
        (b"1.2.3", K.BAD_FLOAT),
        (b"1e999", K.OVERFLOW),
    ],
)
def test_parse_float_bad(text, status):
    buf = _b(text)
    assert K.parse_float_jit(buf, 0, len(buf))[1] == status


@pytest.mark.parametrize("raw", [b"abc", "héllo €".encode(), "😀".encode(), b""])
def test_utf8_valid(raw):
    assert K.utf8_valid_jit(_b(raw), 0, len(raw))


@pytest.mark.parametrize("raw", [b"\xff", b"\xc3", b"\xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80", b"a\x80"])
def test_utf8_invalid(raw):
    assert not K.utf8_valid_jit(_b(raw), 0, len(raw))


def test_split_lines():
    buf = _b(b"ab\n\ncd\nef")
    s, e, consumed = split_lines(buf, final=False)
    assert s.tolist() == [0, 3, 4] and e.tolist() == [2, 3, 6] and consumed == 7
    s, e, consumed = split_lines(buf, final=True)
    assert s.tolist() == [0, 3, 4, 7] and e.tolist() == [2, 3, 6, 9] and consumed == 9
