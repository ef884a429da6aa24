"""HeraldIterableDataset: sharding over DataLoader workers and ranks (every sample once),
torch / torchrec outputs, pin_memory, resume (plain and through torchdata's
StatefulDataLoader), bad arguments, and the example that trains with it."""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import pickle
import sys
import types
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing  # registers torch's tensor reductions on ForkingPickler
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory
from torchdata.stateful_dataloader import StatefulDataLoader

from herald.errors import ConfigError, DataError
from herald.loader import open_source
from herald.loader.batch import SampleBatch
from herald.loader.conversion import datagen
from herald.loader.dataset import HeraldIterableDataset, Jagged, TorchBatch, open_shard, shard_range

REPO = pathlib.Path(__file__).resolve().parents[2]
# torchdata 0.11 calls a torch API that torch 2.13 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

SYNTHETIC = "synthetic://criteo?rows=3001&seed=4"


@pytest.fixture(scope="module")
def parquet_path(tmp_path_factory):
    """2,500 rows in row groups of 300, so shard starts fall inside row groups."""
    path = tmp_path_factory.mktemp("dataset") / "rows.parquet"
    datagen(path, rows=2500, seed=1, row_group_rows=300, progress=False)
    return str(path)


@pytest.fixture(scope="module")
def criteo_tsv(data_dir):
    return str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")


def _plain(spec) -> SampleBatch:
    with open_source(spec) as src:
        return SampleBatch.concat(list(src))


def _sorted_rows(batch: SampleBatch) -> SampleBatch:
    """The rows ordered by (label, dense values, ids): multisets compare with ``equals``."""
    keys = [batch.labels, *batch.dense.T]
    for t in range(batch.num_tables):
        first = np.zeros(len(batch), np.uint64)
        has = batch.lengths(t) > 0
        first[has] = batch.values[t][batch.offsets[t][:-1][has]]
        keys.append(first)
    return batch.take(np.lexsort(keys[::-1]))


def _as_batch(b) -> SampleBatch:
    return (
        b
        if isinstance(b, SampleBatch)
        else SampleBatch(
            b["labels"].numpy(),
            b["dense"].numpy(),
            [b[n][0].numpy().view(np.uint64) for n in _TABLES],
            [b[n][1].numpy() for n in _TABLES],
            _TABLES,
        )
    )


_TABLES = tuple(f"C{i}" for i in range(1, 27))


# ------------------------------------------------------------------ sharding
@pytest.mark.parametrize("rows,shards,batch", [(0, 3, 4), (10, 4, 3), (1001, 4, 100), (7, 8, 2), (4096, 4, 1024)])
def test_shard_ranges_cover_every_row_once(rows, shards, batch):
    ranges = [shard_range(rows, g, shards, batch, False) for g in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    even = [shard_range(rows, g, shards, batch, True) for g in range(shards)]
    sizes = {b - a for a, b in even}
    assert len(sizes) == 1 and sizes.pop() % batch == 0
    assert all(a[1] == b[0] for a, b in zip(even, even[1:])) and even[0][0] == 0
    assert 0 <= rows - even[-1][1] < shards * batch


@pytest.mark.parametrize("spec", ["synthetic", "parquet", "criteo_tsv"])
def test_seeked_shard_equals_rows_of_the_source(spec, parquet_path, criteo_tsv):
    path = {"synthetic": SYNTHETIC, "parquet": parquet_path, "criteo_tsv": criteo_tsv}[spec]
    full = _plain(path)
    for start, stop in [(0, 5), (299, 301), (300, 900), (len(full) - 7, len(full))]:
        with open_shard(path, {}, start, stop) as shard:
            assert SampleBatch.concat(list(shard)).equals(full.slice(start, stop))


@pytest.mark.parametrize("spec,shuffle", [("synthetic", 0), ("parquet", 700), ("criteo_tsv", 0)])
def test_two_workers_two_ranks_yield_every_sample_exactly_once(spec, shuffle, parquet_path, criteo_tsv):
    path = {"synthetic": SYNTHETIC, "parquet": parquet_path, "criteo_tsv": criteo_tsv}[spec]
    got = []
    for rank in range(2):
        dataset = HeraldIterableDataset(path, 256, shuffle_buffer=shuffle, seed=5, rank=rank, world_size=2)
        got += list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert all(isinstance(b, SampleBatch) and 0 < len(b) <= 256 for b in got)
    assert _sorted_rows(SampleBatch.concat(got)).equals(_sorted_rows(_plain(path)))


def test_shards_in_order_equal_the_source_and_drop_last_gives_equal_ranks():
    full = _plain(SYNTHETIC)
    shards = [list(HeraldIterableDataset(SYNTHETIC, 128, rank=r, world_size=4)) for r in range(4)]
    assert SampleBatch.concat([b for s in shards for b in s]).equals(full)
    even = [HeraldIterableDataset(SYNTHETIC, 128, rank=r, world_size=4, drop_last=True) for r in range(4)]
    counts = [[len(b) for b in d] for d in even]
    assert counts == [[128] * 5] * 4  # 3001 // (4 x 128) = 5 full batches per rank
    assert even[0].dropped_rows(0) == 3001 - 4 * 5 * 128
    assert even[0].dropped_rows(2) == 3001 - 8 * 2 * 128 and HeraldIterableDataset(SYNTHETIC, 128).dropped_rows(2) == 0


def test_rank_and_world_size_default_to_torch_distributed(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        d = HeraldIterableDataset(SYNTHETIC, 100)
        assert (d.rank, d.world_size) == (0, 1)
    finally:
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------- outputs
def test_torch_output_shapes_and_dtypes():
    plain = next(iter(HeraldIterableDataset(SYNTHETIC, 200)))
    b = next(iter(DataLoader(HeraldIterableDataset(SYNTHETIC, 200, output="torch"), batch_size=None)))
    assert set(b) == {"labels", "dense", *_TABLES}
    assert b["labels"].dtype == torch.float32 and b["labels"].shape == (200,)
    assert b["dense"].dtype == torch.float32 and b["dense"].shape == (200, 13)
    for t, name in enumerate(_TABLES):
        assert isinstance(b[name], Jagged)
        values, offsets = b[name]
        assert values.dtype == torch.int64 and offsets.dtype == torch.int64 and offsets.shape == (201,)
        assert np.array_equal(values.numpy().view(np.uint64), plain.values[t])  # same 64 bits
    assert _as_batch(b).equals(plain)


def test_torch_batch_crosses_processes_as_four_tensors():
    b = next(iter(HeraldIterableDataset(SYNTHETIC, 100, output="torch")))
    _, args = b.__reduce__()
    assert sum(isinstance(a, torch.Tensor) for a in args) == 4
    again = pickle.loads(ForkingPickler.dumps(b))
    assert isinstance(again, TorchBatch) and list(again) == list(b)
    assert all(isinstance(again[n], Jagged) for n in _TABLES)
    assert _as_batch(again).equals(_as_batch(b))
    assert copy.copy(b) == b and copy.copy(b) is not b


def test_torch_output_of_parquet_is_writable_without_warnings(parquet_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only Arrow buffers are copied, not wrapped
        b = next(iter(HeraldIterableDataset(parquet_path, 100, output="torch")))
    b["dense"][0, 0] = 1.0


def _install_fake_torchrec(monkeypatch):
    class KeyedJaggedTensor:
        def __init__(self, keys, values, lengths):
            self.keys, self.values, self.lengths = keys, values, lengths

    class Batch:
        def __init__(self, dense_features, sparse_features, labels):
            self.dense_features, self.sparse_features, self.labels = dense_features, sparse_features, labels

    modules = {
        name: types.ModuleType(name)
        for name in (
            "torchrec",
            "torchrec.sparse",
            "torchrec.datasets",
            "torchrec.sparse.jagged_tensor",
            "torchrec.datasets.utils",
        )
    }
    modules["torchrec.sparse.jagged_tensor"].KeyedJaggedTensor = KeyedJaggedTensor
    modules["torchrec.datasets.utils"].Batch = Batch
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_kjt_output_layout_with_torchrec(monkeypatch):
    _install_fake_torchrec(monkeypatch)
    plain = next(iter(HeraldIterableDataset(SYNTHETIC, 50)))
    b = next(iter(HeraldIterableDataset(SYNTHETIC, 50, output="kjt")))
    kjt = b.sparse_features
    assert kjt.keys == list(_TABLES) and kjt.lengths.dtype == torch.int32 and kjt.lengths.shape == (26 * 50,)
    assert np.array_equal(kjt.lengths.numpy(), np.concatenate([plain.lengths(t) for t in range(26)]))
    assert np.array_equal(kjt.values.numpy().view(np.uint64), np.concatenate(plain.values))
    assert torch.equal(b.dense_features, torch.from_numpy(plain.dense)) and b.labels.shape == (50,)


def test_kjt_without_torchrec_names_the_install(monkeypatch):
    for name in ("torchrec", "torchrec.datasets.utils", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, name, None)  # importing them raises ImportError
    with pytest.raises(ImportError, match=r"pip install --no-deps torchrec==1\.8\.0"):
        HeraldIterableDataset(SYNTHETIC, 50, output="kjt")


@pytest.mark.parametrize("output", ["batch", "torch"])
def test_pin_memory_pins_every_array(output, monkeypatch):
    """DataLoader(pin_memory=True) calls torch's pin_memory() on each batch; without an
    accelerator pinning raises, so a CPU run checks that every array reaches Tensor.pin_memory."""
    item = next(iter(HeraldIterableDataset(SYNTHETIC, 64, output=output)))
    if not torch.accelerator.is_available():
        calls = []
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: calls.append(t.numel()) or t.clone())
    pinned = torch_pin_memory(item)
    assert _as_batch(pinned).equals(_as_batch(item))
    if torch.accelerator.is_available():
        tensors = (
            [torch.from_numpy(a) for a in (pinned.labels, pinned.dense)]
            if output == "batch"
            else [pinned["labels"], pinned["dense"]]
        )
        assert all(t.is_pinned() for t in tensors)
    else:
        assert len(calls) == 2 + 2 * 26  # labels, dense, values and offsets of each table
    if output == "batch":
        assert not np.shares_memory(pinned.dense, item.dense)


def test_dataloader_with_pin_memory_runs():
    dataset = HeraldIterableDataset(SYNTHETIC, 500, output="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no accelerator is found": DataLoader turns pinning off then
        got = list(DataLoader(dataset, batch_size=None, num_workers=2, pin_memory=True))
    assert _sorted_rows(SampleBatch.concat([_as_batch(b) for b in got])).equals(_sorted_rows(_plain(SYNTHETIC)))


# -------------------------------------------------------------------- resume
@pytest.mark.parametrize("spec,shuffle", [("synthetic", 0), ("synthetic", 600), ("parquet", 0), ("criteo_tsv", 1000)])
def test_resume_mid_epoch_yields_exactly_the_remaining_samples(spec, shuffle, parquet_path, criteo_tsv):
    path = {"synthetic": SYNTHETIC, "parquet": parquet_path, "criteo_tsv": criteo_tsv}[spec]

    def make():
        return HeraldIterableDataset(path, 300, shuffle_buffer=shuffle, seed=2, rank=1, world_size=2)

    full = list(make())
    for stop in (0, 1, len(full) // 2, len(full)):
        first = make()
        it = iter(first)
        got = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        got += list(resumed)
        assert len(got) == len(full) and all(a.equals(b) for a, b in zip(got, full)), f"resume after {stop}"
        assert [len(b) for b in resumed] == [len(b) for b in full]  # the next iteration: the whole epoch


def test_set_epoch_reseeds_the_shuffle_and_forgets_positions():
    d = HeraldIterableDataset(SYNTHETIC, 500, shuffle_buffer=1000, seed=1)
    epoch0 = list(d)
    d.set_epoch(1)
    epoch1 = list(d)
    assert not epoch0[0].equals(epoch1[0])
    assert _sorted_rows(SampleBatch.concat(epoch0)).equals(_sorted_rows(SampleBatch.concat(epoch1)))
    assert d.state_dict()["epoch"] == 1
    it = iter(d)
    next(it)
    d.set_epoch(2)
    assert d.state_dict()["shards"] == {}


def _labels(batches):
    return [b["labels"].numpy().copy() for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch(workers):
    def make():
        return StatefulDataLoader(
            HeraldIterableDataset(SYNTHETIC, 200, output="torch", shuffle_buffer=500, seed=9),
            batch_size=None,
            num_workers=workers,
        )

    full = [_as_batch(b) for b in make()]
    loader = make()
    got = []
    for b in loader:
        got.append(_as_batch(b))
        if len(got) == 5:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    del loader
    resumed = make()
    resumed.load_state_dict(state)
    got += [_as_batch(b) for b in resumed]
    assert len(got) == len(full) and all(a.equals(b) for a, b in zip(got, full))
    again = [_as_batch(b) for b in resumed]  # the following epoch is whole again
    assert len(again) == len(full) and all(a.equals(b) for a, b in zip(again, full))


# ------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"output": "numpy"}, "output must be one of"),
        ({"shuffle_buffer": -1}, "shuffle_buffer must be >= 0"),
        ({"seed": -3}, "seed must be >= 0"),
        ({"rank": 2, "world_size": 2}, r"rank must be in \[0, world_size=2\)"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"drop_last": "yes"}, "drop_last must be a bool"),
        ({"source_options": {"quarantine_path": "q.txt", "bad_records": "skip"}}, "herald convert"),
        ({"source_options": {"colour": "red"}}, "colour"),
    ],
)
def test_bad_arguments_raise_config_errors(kwargs, match):
    args = {"batch_size": 100, **kwargs}
    with pytest.raises(ConfigError, match=match):
        HeraldIterableDataset(SYNTHETIC, args.pop("batch_size"), **args)


def test_kafka_source_is_refused_before_connecting():
    with pytest.raises(ConfigError, match="kafka"):
        HeraldIterableDataset("kafka://127.0.0.1:1/topic?format=tsv", 100)


def test_bad_states_raise():
    d = HeraldIterableDataset(SYNTHETIC, 100)
    with pytest.raises(DataError, match="not a HeraldIterableDataset state"):
        d.load_state_dict({"format": "global_batcher"})
    state = d.state_dict()
    with pytest.raises(ConfigError, match="batch_size=100"):
        HeraldIterableDataset(SYNTHETIC, 200).load_state_dict(state)
    with pytest.raises(ConfigError, match="num_rows"):
        HeraldIterableDataset("synthetic://criteo?rows=3000&seed=4", 100).load_state_dict(state)
    with pytest.raises(DataError, match="malformed"):
        d.load_state_dict({**state, "shards": {"0": {"batcher": 3}}})
    two_ranks = HeraldIterableDataset(SYNTHETIC, 100, rank=0, world_size=2)
    it = iter(two_ranks)
    next(it)
    saved = two_ranks.state_dict()
    d.load_state_dict({**saved, "shards": saved["shards"]})
    with pytest.raises(ConfigError, match="same world_size and num_workers"):
        next(iter(d))
    other_rank = HeraldIterableDataset(SYNTHETIC, 100, rank=1, world_size=2)
    other_rank.load_state_dict(saved)
    with pytest.raises(ConfigError, match="not of shard 1"):
        next(iter(other_rank))


# ------------------------------------------------------------------- example
def test_example_trains_a_plain_model_over_every_sample():
    spec = importlib.util.spec_from_file_location("train_dataloader", REPO / "examples" / "train_dataloader.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--rows", "3000", "--batch-size", "256", "--num-workers", "2", "--rows-per-table", "100"])
    assert out["samples"] == 3000 and out["steps"] == 2 * 6  # 2 workers x 1500 rows: 5 x 256 + 220
    assert np.isfinite(out["first_loss"]) and np.isfinite(out["last_loss"])
