"""Synthetic data: determinism, datagen == stream, fitted skew, learnable labels."""

import numpy as np

from herald.loader import datagen, open_source
from herald.loader.batch import SampleBatch
from herald.loader.splits import RowRange, distinct_ids_per_table
from herald.loader.synthetic import Generator, SyntheticSource, fit_alpha, preset_spec


def _auc(score, label):
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    pos = label == 1
    n1, n0 = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)


def test_same_seed_same_rows_any_read_sizes():
    a = SampleBatch.concat(list(SyntheticSource(preset_spec("criteo-kaggle"), rows=5000, seed=1)))
    s = SyntheticSource(preset_spec("criteo-kaggle"), rows=5000, seed=1)
    b = SampleBatch.concat(list(iter(lambda: s.read(333), None)))
    assert a.equals(b)
    c = SampleBatch.concat(list(SyntheticSource(preset_spec("criteo-kaggle"), rows=5000, seed=2)))
    assert not np.array_equal(a.values[3][:100], c.values[3][:100])


def test_row_range_seeks_past_its_start_without_generating(monkeypatch):
    """A RowRange over the synthetic source (the held-out split) jumps to its start: the
    rows it returns are those a full read gives there, and no row before it is generated."""
    whole = SampleBatch.concat(list(SyntheticSource(preset_spec("criteo-kaggle"), rows=5000, seed=1)))
    made = []
    real = Generator.rows
    monkeypatch.setattr(Generator, "rows", lambda self, start, n: made.append((start, n)) or real(self, start, n))
    with RowRange(SyntheticSource(preset_spec("criteo-kaggle"), rows=5000, seed=1), 4000) as tail:
        got = SampleBatch.concat(list(iter(lambda: tail.read(300), None)))
    assert got.equals(whole.slice(4000, 5000)) and min(s for s, _ in made) == 4000
    assert tail.stats["rows"] == 1000 and sum(n for _, n in made) == 1000


def test_distinct_ids_per_table_equal_numpy_unique_across_growth():
    """The pre-pass's key-map count (which grows its map several times here) equals
    np.unique of every table's ids."""
    src = SyntheticSource(preset_spec("criteo-kaggle"), rows=40000, seed=3)
    batches = list(iter(lambda: src.read(7000), None))
    whole = SampleBatch.concat(batches)
    assert distinct_ids_per_table(batches) == [int(np.unique(v).shape[0]) for v in whole.values]
    assert sum(distinct_ids_per_table(batches)) > 1 << 16


def test_datagen_file_equals_stream(tmp_path):
    datagen(tmp_path / "s.parquet", rows=20000, seed=9, row_group_rows=4096, progress=False)
    with open_source(tmp_path / "s.parquet") as f:
        written = SampleBatch.concat(list(f))
    streamed = SampleBatch.concat(list(open_source("synthetic://criteo?rows=20000&seed=9")))
    assert written.equals(streamed)


def test_fit_from_real_file_and_skew(data_dir):
    path = data_dir / "criteo/criteo_kaggle_sample_train.tsv"
    s = open_source(f"synthetic://fit?path={path}&rows=30000&seed=0")
    spec = s.spec
    assert spec.cardinalities[8] == 3 and spec.cardinalities[2] > 3000
    assert abs(spec.ctr - 1549 / 7200) < 1e-3
    assert 0.4 < spec.missing_rates[21] < 0.9  # C22 is mostly empty
    b = SampleBatch.concat(list(s))
    for t in (2, 8):
        assert len(np.unique(b.values[t])) <= spec.cardinalities[t]
    _, counts = np.unique(b.values[2], return_counts=True)
    assert counts.max() > 20 * np.median(counts)  # skewed popularity
    assert 0.1 < b.labels.mean() < 0.4


def test_fit_alpha_recovers_exponent():
    ranks = np.arange(1, 2001)
    counts = np.round(1e5 * ranks**-1.2)
    assert abs(fit_alpha(counts) - 1.2) < 0.1
    assert fit_alpha(np.ones(50)) == 0.0


def test_labels_learnable():
    b = SampleBatch.concat(list(open_source("synthetic://criteo?rows=40000&seed=4")))
    y = b.labels
    assert _auc(b.dense[:, 0] + b.dense[:, 1] + b.dense[:, 2], y) > 0.55
    # per-id click rate of table 0 (popular ids) predicts labels too
    ids = b.values[0]
    uniq, inv = np.unique(ids, return_inverse=True)
    rate = np.bincount(inv, weights=y) / np.bincount(inv)
    assert _auc(rate[inv], y) > 0.55


def test_big_stream_bounded_memory():
    s = SyntheticSource(preset_spec("criteo-kaggle"), rows=10**9, seed=0)
    s.load_state_dict({**s.state_dict(), "row": 10**9 - 10})
    assert len(s.read(100)) == 10 and s.read(100) is None
