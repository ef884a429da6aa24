"""Value checks at the loader boundary: the labels and dense features of columnar data.

NOTE [value checks]: a sample decoded from columnar data (Parquet files, Arrow records
from Kafka) is a bad record (NOTE [bad records] in :mod:`herald.loader.policy`) when

    bad_label   its label is not finite or not in [0, 1] (the models train a binary
                cross-entropy: a label 2 or NaN makes the loss NaN);
    bad_dense   one of its dense values is not finite or ``|x| > DENSE_LIMIT`` (1e30).

Why 1e30: float32 ends at 3.4e38, and a value that large overflows to inf in the first
layer that multiplies or sums it, so a single such sample turns the dense replicas NaN.
1e30 leaves eight orders of magnitude for weights and sums of a few thousand features
while no real feature (counts, log counts, normalised values) comes near it. A label
check reports ``bad_label`` when both checks fail.

Text formats cannot hold such values (Criteo/Avazu/libFM labels parse as 0/1, MovieLens
labels are a comparison, Criteo dense values are ``log(1 + x)`` of an int64, at most
43.7), and synthetic data is generated finite, so only the columnar decoders call this.
The check is vectorised: a batch with no bad value costs one min and one max per array.
"""

from __future__ import annotations

import numpy as np

from herald.loader.kernels import BAD_DENSE, BAD_LABEL

#: Largest accepted magnitude of a dense feature (NOTE [value checks]).
DENSE_LIMIT = 1e30


def value_status(labels: np.ndarray, dense: np.ndarray) -> np.ndarray | None:
    """NOTE [record status] codes of the samples' values, or None when every sample is good.

    Args:
        labels: float32 [B]; dense: float32 [B, D] (D may be 0).

    Returns:
        None (all good: the common case, two reductions per array), else int8 [B]:
        0 good, ``BAD_LABEL`` or ``BAD_DENSE``.
    """
    labels_ok = labels.size == 0 or bool(labels.min() >= 0.0) and bool(labels.max() <= 1.0)  # NaN: False
    dense_ok = dense.size == 0 or bool(dense.min() >= -DENSE_LIMIT) and bool(dense.max() <= DENSE_LIMIT)
    if labels_ok and dense_ok:
        return None
    status = np.zeros(labels.shape[0], np.int8)
    if not dense_ok:
        status[~(np.abs(dense) <= DENSE_LIMIT).all(axis=1)] = BAD_DENSE
    if not labels_ok:
        status[~((labels >= 0.0) & (labels <= 1.0))] = BAD_LABEL
    return status


def describe(labels: np.ndarray, dense: np.ndarray, row: int) -> str:
    """What is wrong with sample ``row`` (for error messages), e.g. ``"label nan"``."""
    label = float(labels[row])
    if not 0.0 <= label <= 1.0:
        return f"label {label!r} (labels must be finite and in [0, 1])"
    bad = np.flatnonzero(~(np.abs(dense[row]) <= DENSE_LIMIT))
    k = int(bad[0]) if bad.size else 0
    return f"dense feature {k} is {float(dense[row, k])!r} (dense values must be finite with |x| <= {DENSE_LIMIT:g})"
