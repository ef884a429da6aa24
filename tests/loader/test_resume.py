"""Record-level resume for every source, the GlobalBatcher and the GlobalBatches producer
(one shared harness)."""

import functools
import json

import numpy as np
import pytest

from herald.errors import ConfigError, DataError
from herald.loader import GlobalBatcher, convert, open_source
from herald.loader.batch import SampleBatch
from herald.loader.global_batches import GlobalBatches, KafkaRecords, record_sample_ids
from herald.loader.kafka.config import KafkaPosition
from herald.loader.source import Source

from .resume_harness import check_batcher_resume, check_source_resume

BAD = b"1\tx\t" + b"\t".join([b"3"] * 12) + b"\t" + b"\t".join([b"ab"] * 26) + b"\n"


@pytest.fixture(scope="module")
def parquet_path(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("pq") / "criteo_dev.parquet"
    convert(data_dir / "criteo/criteo_kaggle_sample_train.tsv", out, row_group_rows=1000, progress=False)
    return out


@pytest.fixture(scope="module")
def criteo_with_bad(tmp_path_factory, data_dir):
    lines = (data_dir / "criteo/criteo_kaggle_sample_dev.tsv").read_bytes().splitlines(keepends=True)
    p = tmp_path_factory.mktemp("bad") / "mixed.tsv"
    p.write_bytes(
        b"".join(line + (BAD if i % 37 == 0 else b"") + (b"\n" if i % 53 == 0 else b"") for i, line in enumerate(lines))
    )
    return p


@pytest.mark.parametrize(
    "rel,options",
    [
        ("criteo/criteo_kaggle_sample_dev.tsv", {}),
        ("criteo/criteo_kaggle_sample_dev.tsv", {"chunk_bytes": 4096}),
        ("avazu/avazu_sample_train.csv", {"chunk_bytes": 65536}),
        ("avazu/avazu_sample_dev.csv", {}),
        ("frappe/frappe.test.libfm", {"chunk_bytes": 300000}),
        ("movielens/ml-100k/u.data", {}),
        ("movielens/ml-latest-small/ratings.csv", {}),
    ],
)
def test_resume_real_files(data_dir, rel, options):
    max_read = 3000 if "movielens" in rel or "frappe" in rel else 300
    check_source_resume(functools.partial(open_source, data_dir / rel, **options), max_read=max_read)


def test_resume_skip_policy_counts(criteo_with_bad, tmp_path):
    full = check_source_resume(
        functools.partial(open_source, criteo_with_bad, bad_records="skip", chunk_bytes=8192), trials=4
    )
    assert len(full) == 409


def test_resume_parquet(parquet_path):
    check_source_resume(functools.partial(open_source, parquet_path), max_read=2500)


def test_resume_synthetic():
    check_source_resume(functools.partial(open_source, "synthetic://criteo?rows=5000&seed=7"), max_read=900)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"drop_last": True, "epochs": 2},
        {"shuffle_buffer": 1000, "seed": 3, "epochs": 2},
        {"shuffle_buffer": 700, "seed": 1, "drop_last": True},
    ],
)
def test_resume_batcher(parquet_path, kwargs):
    make = lambda: GlobalBatcher(open_source(parquet_path), 512, **kwargs)  # noqa: E731
    full = check_batcher_resume(make, trials=2)
    if kwargs.get("drop_last"):
        assert all(len(b) == 512 for b in full)
    assert sum(len(b) for b in full) <= 7200 * kwargs.get("epochs", 1)


def test_resume_batcher_text_source(data_dir):
    make = lambda: GlobalBatcher(
        open_source(data_dir / "avazu/avazu_sample_train.csv", chunk_bytes=50000),  # noqa: E731
        1000,
        shuffle_buffer=2000,
        epochs=2,
    )
    check_batcher_resume(make, trials=2)


def test_malformed_states(data_dir, parquet_path):
    with open_source(data_dir / "criteo/criteo_kaggle_sample_dev.tsv") as s:
        good = s.state_dict()
        for bad in [
            None,
            {},
            {**good, "format": "avazu"},
            {**good, "offset": -1},
            {**good, "offset": "x"},
            {**good, "path": "other.tsv"},
            {**good, "offset": 10**12},
            {**good, "skipped": [1]},
        ]:
            with pytest.raises(DataError):
                s.load_state_dict(bad)
    with open_source(parquet_path) as s:
        with pytest.raises(DataError):
            s.load_state_dict({**s.state_dict(), "file": "nope.parquet"})
    b = GlobalBatcher(open_source(parquet_path), 64)
    with pytest.raises(ConfigError):
        GlobalBatcher(open_source(parquet_path), 128).load_state_dict(b.state_dict())
    with pytest.raises(DataError):
        b.load_state_dict({"format": "global_batcher", "epoch": -1})


# ---------------------------------------------------------------- GlobalBatches (the job's producer)


def _producer(source, gb=500, **kw):
    return lambda: GlobalBatches(source(), gb, **kw)  # noqa: E731


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"epochs": 3, "train_rows": 5300},
        {"epochs": 2, "train_rows": 6100, "max_steps": 17},
        {"epochs": 2, "prefetch_batches": 0},
    ],
)
def test_resume_global_batches(parquet_path, kwargs):
    full = check_batcher_resume(_producer(lambda: open_source(parquet_path), **kwargs), trials=3)
    assert all(len(b) == 500 for b in full)
    rows = kwargs.get("train_rows", 7200)
    per_epoch = rows // 500
    with _producer(lambda: open_source(parquet_path), **kwargs)() as p:
        got = list(p)
        expected = min(per_epoch * kwargs.get("epochs", 1), kwargs.get("max_steps") or 10**9)
        assert p.info["batches"] == len(got) == expected
        assert p.info["samples"] == 500 * expected
        if "max_steps" not in kwargs:
            assert p.info["dropped_samples"] == (rows % 500) * kwargs.get("epochs", 1)
    # epoch e repeats the first train_rows rows
    with open_source(parquet_path) as src:
        first = SampleBatch.concat(list(src)).slice(0, per_epoch * 500)
    assert SampleBatch.concat(got[:per_epoch]).equals(first)
    if kwargs.get("epochs", 1) > 1 and expected > per_epoch:
        assert got[per_epoch].equals(got[0])


def test_resume_global_batches_text_source(data_dir):
    path = data_dir / "criteo/criteo_kaggle_sample_train.tsv"
    check_batcher_resume(
        _producer(lambda: open_source(path, chunk_bytes=60000), 320, epochs=2, train_rows=3000), trials=3
    )


def test_global_batches_max_steps_counts_the_whole_job(parquet_path):
    make = _producer(lambda: open_source(parquet_path), 500, epochs=2, max_steps=20)
    with make() as p:
        first = [next(p) for _ in range(12)]
        state = json.loads(json.dumps(p.state_dict()))
    with make() as p:
        p.load_state_dict(state)
        rest = list(p)
    assert len(first) + len(rest) == 20 and p.info["batches"] == 20


def test_global_batches_errors(parquet_path):
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        GlobalBatches(open_source(parquet_path), 500, train_rows=499)
    with GlobalBatches(open_source(parquet_path), 500) as p:
        next(p)
        good = p.state_dict()
        for bad, err in [
            (None, DataError),
            ({**good, "format": "global_batcher"}, DataError),
            ({**good, "info": {"batches": -1, "samples": 0, "dropped_samples": 0}}, DataError),
            ({**good, "info": {"batches": 1}}, DataError),
            ({**good, "batcher": None}, DataError),
            ({**good, "global_batch": 400}, ConfigError),
            ({**good, "rows_per_epoch": 10}, ConfigError),
        ]:
            with pytest.raises(err):
                p.load_state_dict(bad)
        assert p.sample_ids(0) is None and p.position(0) is None  # a file has no tracker


class _Records(Source):
    """A Kafka-shaped source over synthetic rows: record ``r // 10`` of partition 0 holds
    rows ``r``; it has ``position``, ``last_read_position`` and ``last_read_records``."""

    format_name = "fake_kafka"
    PER_RECORD = 10

    def __init__(self, rows=2000):
        super().__init__()
        self.inner = open_source(f"synthetic://criteo?rows={rows}&seed=4")
        self.row = 0
        self.last_read_position = self.position
        self.last_read_records = (np.zeros(0, np.int32), np.zeros(0, np.int64))

    @property
    def schema(self):
        return self.inner.schema

    @property
    def position(self):
        return KafkaPosition("t", {0: divmod(self.row, self.PER_RECORD)})

    def _read(self, max_rows):
        b = self.inner.read(min(max_rows, 7))  # reads end inside records
        if b is None:
            return None
        rows = np.arange(self.row, self.row + len(b))
        self.row += len(b)
        self.last_read_records = (np.zeros(len(b), np.int32), rows // self.PER_RECORD)
        self.last_read_position = self.position
        return b

    def _get_state(self):
        return {"row": self.row, "inner": self.inner.state_dict()}

    def _set_state(self, state):
        self.row = state["row"]
        self.inner.load_state_dict(state["inner"])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_kafka_records_ids_and_positions_survive_resume(prefetch):
    make = lambda: GlobalBatches(
        _Records(),
        64,
        tracker=KafkaRecords(dispatcher_rank=3),  # noqa: E731
        prefetch_batches=prefetch,
    )
    full = check_batcher_resume(make, trials=4, seed=1)
    with make() as p:
        for i, _ in enumerate(p):
            k = np.arange(64 * i, 64 * (i + 1))
            want = record_sample_ids(3, np.zeros(64, np.int32), k // 10, k % 10)
            assert np.array_equal(p.sample_ids(i), want)
            assert p.position(i).offsets == {0: divmod(64 * (i + 1), 10)}
        assert i + 1 == len(full) == 2000 // 64 and p.info["dropped_samples"] == 2000 % 64
        p.release(5)
        assert p.sample_ids(5) is None and p.sample_ids(6) is not None
    with pytest.raises(ConfigError, match="shuffle_buffer=0"):
        GlobalBatcher(_Records(), 64, shuffle_buffer=100, tracker=KafkaRecords())
