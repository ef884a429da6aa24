"""NOTE [death notices] (herald/deaths.py): a child's death as its supervisor learns it, the
notice beside an ipc shard's socket, and every PS client's wait ending on it."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.deaths import ExitWatch, NoticeCheck, notice_path, read_notice, write_notice
from herald.errors import PeerLost
from herald.procs import Supervisor
from herald.ps import LocalShards, PSClient

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
HANG_GUARD_S = 10.0  # a wait the death should end at once; this bound only keeps a broken test from hanging


def test_the_notice_lies_beside_an_ipc_socket_and_tcp_has_none(tmp_path):
    assert notice_path(f"ipc://{tmp_path}/shard-3.ipc") == tmp_path / "shard-3.dead"
    assert notice_path("tcp://127.0.0.1:5555") is None
    assert notice_path(f"ipc://{tmp_path}/socket") is None  # not NAME.ipc: no notice to look for
    assert NoticeCheck.of(["tcp://127.0.0.1:5555"]) is None  # nothing a client could read


def test_a_notice_fails_the_check_of_its_shard_only(tmp_path):
    addresses = [f"ipc://{tmp_path}/shard-0.ipc", f"ipc://{tmp_path}/shard-1.ipc", "tcp://127.0.0.1:1"]
    check = NoticeCheck.of(addresses)
    for shard in range(3):
        check(shard)  # no notice: alive
    write_notice(tmp_path / "shard-1.dead", "PS shard 1 was killed by signal 9 (SIGKILL); its log ...", 1234.5)
    assert (tmp_path / "shard-1.dead").stat().st_mode & 0o777 == 0o600
    assert read_notice(tmp_path / "shard-1.dead") == {
        "message": "PS shard 1 was killed by signal 9 (SIGKILL); its log ...",
        "unix_s": 1234.5,
    }
    check = NoticeCheck.of(addresses)  # a client of these shards from now on
    check(0)
    check(2)
    with pytest.raises(PeerLost, match=r"^PS shard 1 was killed by signal 9 \(SIGKILL\)") as lost:
        check(1)
    assert lost.value.peer == addresses[1] and lost.value.unix_s == 1234.5


def test_an_unreadable_notice_still_names_a_death(tmp_path):
    (tmp_path / "shard-0.dead").write_text("{not json")
    assert "died" in read_notice(tmp_path / "shard-0.dead")["message"]
    assert read_notice(tmp_path / "missing.dead") is None


def test_the_exit_watch_calls_back_once_a_process_ends():
    ended, seen = threading.Event(), []
    watch = ExitWatch(lambda key: (seen.append(key), ended.set()))
    proc = subprocess.Popen(SLEEPER)
    try:
        watch.add(proc.pid, "sleeper")
        assert not ended.wait(0.2)  # alive: nothing said
        os.kill(proc.pid, signal.SIGKILL)
        assert ended.wait(HANG_GUARD_S), "the exit watch did not see the child end"
        assert seen == ["sleeper"]
    finally:
        proc.kill()
        proc.wait(5)
        watch.close()
        watch.close()  # idempotent


def test_the_supervisor_tells_a_death_it_did_not_cause_with_the_signal(tmp_path):
    dead, names = threading.Event(), []
    with Supervisor(tmp_path, on_death=lambda name: (names.append(name), dead.set())) as sup:
        sup.start("stopped", SLEEPER)
        sup.kill("stopped")  # the supervisor's own stop: no death to tell
        sup.start("victim", SLEEPER)
        before = time.time()
        os.kill(sup.procs["victim"].pid, signal.SIGKILL)
        assert dead.wait(HANG_GUARD_S), "on_death was not called"
        assert names == ["victim"]
        assert sup.exit_status("victim") == "was killed by signal 9 (SIGKILL)"
        assert before <= sup.died_at("victim") <= time.time()
        assert sup.died_at("stopped") is None
        assert sup.failure().startswith("victim was killed by signal 9 (SIGKILL)")


TABLES = [TableConfig("t0", 4, OptimizerConfig("sgd", lr=0.1))]


def test_a_client_waiting_on_a_shard_that_is_killed_names_it_at_once():
    """A step message held by the shard (rank 1's never comes) with a 60 s timeout: kill -9 of
    the shard ends the wait with the shard's notice (its index, address, signal, log), long
    before the timeout; the dispatcher's admin ops wait the same way."""
    with LocalShards(num_shards=1, tables=TABLES, transport="ipc") as shards:
        with PSClient(shards.addresses, tables=TABLES, timeout_ms=60_000, num_workers=2) as client:
            held = client.step_async(0, 0, 2, pull=(np.zeros(2, np.uint16), np.arange(2, dtype=np.uint64)))
            t0 = time.monotonic()
            os.kill(shards.pid(0), signal.SIGKILL)
            with pytest.raises(PeerLost) as lost:
                held.wait()
            assert time.monotonic() - t0 < HANG_GUARD_S
            message = str(lost.value)
            assert message.startswith(f"PS shard 0 at {shards.addresses[0]} (pid ") and "signal 9 (SIGKILL)" in message
            assert str(shards.log_path(0)) in message and "serving on" in message  # the log's tail
            with pytest.raises(PeerLost, match="PS shard 0"):  # and every later wait on it
                client.stats()
        assert pathlib.Path(notice_path(shards.addresses[0])).exists()
        assert shards.died_at() is not None
        shards.restart(0)  # a fresh shard on the address: its notice is gone
        assert not notice_path(shards.addresses[0]).exists()
        with PSClient(shards.addresses, tables=TABLES, timeout_ms=60_000) as client:
            assert len(client.stats()) == 1
