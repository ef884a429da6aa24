"""GlobalBatcher: sizes, drop_last, shuffle, epochs, prefetch errors, bounded close."""

import threading

import numpy as np
import pytest

from herald.errors import ConfigError, DataError
from herald.loader import GlobalBatcher, open_source
from herald.loader.batch import SampleBatch
from herald.loader.source import Source
from tests.fakes import wait_until


def _syn(rows=1000):
    return open_source(f"synthetic://criteo?rows={rows}&seed=0")


def test_sizes_and_final_short_batch():
    sizes = [len(b) for b in GlobalBatcher(_syn(1000), 300)]
    assert sizes == [300, 300, 300, 100]
    assert [len(b) for b in GlobalBatcher(_syn(1000), 300, drop_last=True)] == [300, 300, 300]


def test_epochs_reread_source():
    batches = list(GlobalBatcher(_syn(500), 200, epochs=2))
    assert [len(b) for b in batches] == [200, 200, 100, 200, 200, 100]
    assert batches[0].equals(batches[3])


def test_shuffle_is_a_permutation_and_seeded():
    plain = SampleBatch.concat(list(GlobalBatcher(_syn(2000), 256)))
    shuf = SampleBatch.concat(list(GlobalBatcher(_syn(2000), 256, shuffle_buffer=500, seed=1)))
    again = SampleBatch.concat(list(GlobalBatcher(_syn(2000), 256, shuffle_buffer=500, seed=1)))
    assert shuf.equals(again) and not shuf.equals(plain)
    assert np.array_equal(np.sort(shuf.values[0]), np.sort(plain.values[0]))
    assert np.array_equal(np.sort(shuf.dense[:, 4]), np.sort(plain.dense[:, 4]))


def test_settings_validated():
    with pytest.raises(ConfigError):
        GlobalBatcher(_syn(), 0)
    with pytest.raises(ConfigError):
        GlobalBatcher(_syn(), 10, epochs=0)


class _Failing(Source):
    format_name = "failing"

    def __init__(self, fail_after=2):
        super().__init__()
        self.inner = _syn(10_000)
        self.n = 0
        self.fail_after = fail_after

    @property
    def schema(self):
        return self.inner.schema

    def _read(self, max_rows):
        self.n += 1
        if self.n > self.fail_after:
            raise DataError("boom", source="failing", position=self.n, reason="test")
        return self.inner.read(max_rows)

    def _get_state(self):
        return {}

    def _set_state(self, state):
        pass


def test_thread_exception_reaches_consumer():
    b = GlobalBatcher(_Failing(2), 100)
    got = []
    with pytest.raises(DataError, match="boom"):
        for batch in b:
            got.append(batch)
    assert len(got) == 2
    b.close(1.0)
    assert not b.prefetching


class _Blocking(_Failing):
    """Its second read blocks until ``release`` is set (a stream with no data)."""

    def __init__(self):
        super().__init__()
        self.blocked, self.release = threading.Event(), threading.Event()

    def _read(self, max_rows):
        if self.n >= 1:
            self.blocked.set()
            self.release.wait(120)
        self.n += 1
        return self.inner.read(max_rows)


def test_close_is_bounded():
    """close(timeout_s) gives up on a prefetch thread blocked in a read: it returns with the
    thread still prefetching while the read blocks (only the test ends it, after close)."""
    source = _Blocking()
    b = GlobalBatcher(source, 100, prefetch_batches=1)
    next(b)
    assert source.blocked.wait(30), "the prefetch thread never started its second read"
    b.close(timeout_s=0.3)
    assert b.prefetching and not source.release.is_set()
    b.close(0.1)  # idempotent, still bounded
    assert b.prefetching
    with pytest.raises(StopIteration):
        next(b)
    source.release.set()


def test_close_stops_running_thread_and_queue_bounded():
    b = GlobalBatcher(_syn(100_000), 100, prefetch_batches=2)
    next(b)
    wait_until(b._queue.full, 30, "the prefetch thread filling its queue (then blocked on the next put)")
    assert b._queue.qsize() <= 2
    b.close(2.0)
    assert not b.prefetching
    assert not any(t.name == "herald-prefetch" and t.is_alive() and t is b._thread for t in threading.enumerate())


def test_stats():
    b = GlobalBatcher(_syn(1000), 300)
    list(b)
    assert b.stats["rows"] == 1000 and b.stats["batches"] == 4 and b.stats["source"]["rows"] == 1000
