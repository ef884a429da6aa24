"""Atomic checkpoints: round trip, torn and corrupt files detected (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.ps import CheckpointError, checkpoint
from herald.ps.table import EmbeddingTable


def _tables():
    cfgs = [TableConfig("a", 4, OptimizerConfig("adam")), TableConfig("b", 3, OptimizerConfig("adagrad"))]
    tables = [EmbeddingTable(c, i, 9) for i, c in enumerate(cfgs)]
    for t in tables:
        keys = np.arange(500, dtype=np.uint64) * 3
        t.push_grad(keys, np.ones((500, t.cfg.dim), np.float32), np.ones(500, np.uint16), 0, 0)
    return tables


def test_round_trip(tmp_path):
    tables = _tables()
    path = checkpoint.save(tmp_path, 1, 2, 9, tables)
    assert path.name == "shard-1-of-2" and not list(tmp_path.glob(".*"))
    data = checkpoint.load(tmp_path, 1, 2, 9, tables)
    fresh = [EmbeddingTable(t.cfg, t.index, 9) for t in tables]
    for t, f, (k, r) in zip(tables, fresh, data):
        f.load(k, r)
        keys = np.arange(600, dtype=np.uint64) * 3
        assert np.array_equal(t.pull(keys)[0], f.pull(keys)[0])
    checkpoint.save(tmp_path, 1, 2, 9, tables)  # overwrite is atomic too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-1-of-2"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "missing", "layout", "seed"])
def test_damaged_checkpoint_is_detected(tmp_path, damage):
    tables = _tables()
    folder = checkpoint.save(tmp_path, 0, 1, 9, tables)
    rows_file = folder / "t0.rows"
    shard, seed = 0, 9
    if damage == "flip":
        data = bytearray(rows_file.read_bytes())
        data[100] ^= 1
        rows_file.write_bytes(bytes(data))
    elif damage == "truncate":
        rows_file.write_bytes(rows_file.read_bytes()[:-7])
    elif damage == "manifest":
        (folder / "manifest.json").write_text("{not json")
    elif damage == "missing":
        (folder / "manifest.json").unlink()
    elif damage == "layout":
        (folder.parent / "shard-0-of-1").rename(folder.parent / "shard-1-of-1")
        shard = 1
        folder = folder.parent / "shard-1-of-1"
    else:
        seed = 10
    with pytest.raises(CheckpointError):
        checkpoint.load(tmp_path, shard, 1, seed, tables)


def test_clocks_are_saved_when_asked_and_restored(tmp_path):
    """NOTE [embedding clocks]: a checkpoint off the grid keeps the rows' c_g (NOTE [warm resume]
    in herald/dispatch/warm.py); one without them restores the clocks at 0."""
    tables = _tables()
    keys = np.arange(500, dtype=np.uint64) * 3
    tables[0].push_rows(keys[:3], np.ones((3, tables[0].width), np.float32), np.array([4, 0, 9], np.uint64))
    want = [t.clocks[: t.n_rows].copy() for t in tables]
    assert want[0].max() > 1  # the push above and the gradient before it
    plain, clocked = tmp_path / "plain", tmp_path / "clocked"
    checkpoint.save(plain, 0, 1, 9, tables)
    checkpoint.save(clocked, 0, 1, 9, tables, clocks=True)
    assert not list((plain / "shard-0-of-1").glob("*.clocks"))
    assert [c is None for *_, c in checkpoint.load(plain, 0, 1, 9, tables, with_clocks=True)] == [True, True]
    data = checkpoint.load(clocked, 0, 1, 9, tables, with_clocks=True)
    for t, w, (k, r, c) in zip(tables, want, data):
        fresh = EmbeddingTable(t.cfg, t.index, 9)
        fresh.load(k, r, clocks=c)
        assert np.array_equal(fresh.clocks[: fresh.n_rows], w)
    assert [len(x) for x in checkpoint.load(clocked, 0, 1, 9, tables)] == [2, 2]  # (keys, rows) unless asked
    (clocked / "shard-0-of-1" / "t1.clocks").write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError, match="t1.clocks"):
        checkpoint.load(clocked, 0, 1, 9, tables, with_clocks=True)
