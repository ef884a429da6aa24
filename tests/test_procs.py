"""The process supervisor shared by ``herald train`` and ``LocalShards``; the core plan
and pinning of ``--pin-cores``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from herald.errors import ConfigError, HeraldError
from herald.procs import Supervisor, core_plan, cpu_seconds, pin_to_cores, tree_cpu_seconds
from tests.fakes import wait_until


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_check_names_the_child_that_exited_with_its_log_tail(tmp_path):
    with Supervisor(tmp_path, env={"HERALD_TEST_WORD": "marmot"}) as sup:
        sup.start("fine", _python("import time; time.sleep(30)"))
        sup.start(
            "bad",
            _python(
                "import os, sys\n"
                "for i in range(40): print('line', i)\n"
                "print('dying:', os.environ['HERALD_TEST_WORD'], file=sys.stderr)\n"
                "sys.exit(3)"
            ),
        )
        sup.procs["bad"].wait(30)
        with pytest.raises(HeraldError) as info:
            sup.check()
        msg = str(info.value)
        assert msg.startswith("bad exited with code 3") and str(tmp_path / "bad.log") in msg
        assert "dying: marmot" in msg and "line 39" in msg and "line 20" not in msg  # the tail only
        assert sup.failure() == msg
    assert sup.procs["fine"].poll() is not None  # closed: stopped
    assert sup.failure() == msg  # a crash before the stop stays a failure
    sup.close()  # idempotent


def test_failure_waits_up_to_grace_and_ignores_clean_exits(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start("ok", _python("pass"))
        sup.procs["ok"].wait(30)
        assert sup.failure() is None
        go = tmp_path / "go"
        sup.start(
            "late",
            _python(f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nsys.exit(2)"),
        )
        assert sup.failure(grace_s=0.0) is None  # it runs until the test lets it fail
        go.touch()
        msg = sup.failure(grace_s=20.0)
        assert msg is not None and msg.startswith("late exited with code 2")


def test_stop_kills_a_child_that_ignores_sigterm_within_the_bound(tmp_path):
    sup = Supervisor(tmp_path, new_session=True)
    p = sup.start(
        "stubborn",
        _python(
            "import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)"
        ),
    )
    deadline = time.monotonic() + 30
    while "ready" not in sup.tail("stubborn") and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    sup.stop(timeout_s=0.5)
    assert p.poll() == -9  # SIGKILL after the bound: a stop that waited for the child would see it exit 0 after 60 s
    assert time.monotonic() - t0 < 30  # generous: a loaded machine delays the kill by seconds, not the child's 60 s
    assert sup.failure() is None  # stopped on purpose: not a failure
    sup.close()


def test_wait_is_bounded_and_names_the_child(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start("sleeper", _python("import time; time.sleep(60)"))
        with pytest.raises(HeraldError, match="sleeper did not exit within 0 s after the test"):
            sup.wait(timeout_s=0.3, context=" after the test")
        assert sup.procs["sleeper"].poll() is None  # gave up on a child that still runs (for 60 s)


def test_restart_appends_to_the_log_and_a_running_name_is_refused(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start("w", _python("print('first')"))
        sup.procs["w"].wait(30)
        sup.start("w", _python("print('second', flush=True); import time; time.sleep(30)"))
        with pytest.raises(ConfigError, match="already running"):
            sup.start("w", _python("pass"))
        deadline = time.monotonic() + 30
        while "second" not in sup.tail("w") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sup.terminate("w", timeout_s=5.0) == -15
        assert (tmp_path / "w.log").read_text().split() == ["first", "second"]


def test_core_plan_gives_each_process_cores_of_its_own_while_there_are_enough():
    assert core_plan(3, range(8)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert core_plan(1, [2, 5]) == [[2, 5]]
    assert core_plan(2, [6, 4]) == [[6], [4]]  # in the order given
    for cores in range(1, 13):
        for n in range(1, cores + 1):
            plan = core_plan(n, range(cores))
            assert [c for block in plan for c in block] == list(range(cores))  # disjoint, every core used
            assert max(map(len, plan)) - min(map(len, plan)) <= 1


def test_core_plan_round_robin_with_more_processes_than_cores():
    assert core_plan(5, [0, 1]) == [[0], [1], [0], [1], [0]]
    assert core_plan(3, [7]) == [[7], [7], [7]]


@pytest.mark.parametrize("n,available", [(0, [0]), (2, []), (2, [1, 1])])
def test_core_plan_refuses_no_process_no_core_or_a_repeated_core(n, available):
    with pytest.raises(ConfigError):
        core_plan(n, available)


def _threads_cores(pid: int) -> list[set[int]]:
    """The cores of every thread of ``pid``."""
    return [os.sched_getaffinity(int(t.name)) for t in pathlib.Path(f"/proc/{pid}/task").iterdir()]


def test_a_child_started_with_cores_runs_on_them_from_its_start(tmp_path):
    core = max(os.sched_getaffinity(0))
    with Supervisor(tmp_path) as sup:
        sup.start("pinned", _python("import os; print(sorted(os.sched_getaffinity(0)))"), cores=[core])
        sup.start("free", _python("import os; print(sorted(os.sched_getaffinity(0)))"))
        sup.wait(30)
        assert sup.tail("pinned") == str([core])
        assert sup.tail("free") == str(sorted(os.sched_getaffinity(0)))


def test_pin_to_cores_pins_every_thread_of_a_running_process_and_its_later_threads(tmp_path):
    core = max(os.sched_getaffinity(0))
    go = tmp_path / "go"
    code = (
        "import os, threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('ready', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"  # the test pins it meanwhile
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('more', flush=True); time.sleep(60)"
    )
    with Supervisor(tmp_path) as sup:
        p = sup.start("threads", _python(code))
        deadline = time.monotonic() + 30
        while "ready" not in sup.tail("threads") and time.monotonic() < deadline:
            time.sleep(0.05)
        pin_to_cores([core], p.pid)
        assert _threads_cores(p.pid) == [{core}] * 4
        go.touch()
        while "more" not in sup.tail("threads") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads_cores(p.pid) == [{core}] * 5  # the thread started after the pin took its creator's cores


def test_startup_garbage_is_frozen_and_the_collector_restored():
    """NOTE [start-up garbage]: no collection runs inside; what was made there is frozen
    after it; the collector is on after it, also when it was off before (as ``herald serve
    worker`` turns it off before its imports)."""
    import gc

    from herald.procs import startup_garbage_frozen

    runs = []
    callback = lambda phase, info: runs.append(phase)  # noqa: E731
    gc.callbacks.append(callback)
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            gc.unfreeze()
            with startup_garbage_frozen():
                assert not gc.isenabled()
                made = [[i] for i in range(50_000)]  # far past the young generation's threshold
                assert runs == []
            assert gc.isenabled() and gc.get_freeze_count() >= len(made)
            gc.unfreeze()
            runs.clear()
    finally:
        gc.callbacks.remove(callback)
        gc.unfreeze()
        gc.enable()


def test_tree_cpu_counts_running_descendants_and_them_once_reaped(tmp_path):
    # a grandchild burning CPU under a child that waits for it (what a shard or a worker is)
    burn = "import time; t = time.process_time(); exec('while time.process_time() - t < 0.6: pass')"
    reaped = tmp_path / "reaped"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import pathlib, subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}]); "
            f"pathlib.Path({str(reaped)!r}).touch(); import time; time.sleep(30)",
        ]
    )
    try:
        t0, own0 = tree_cpu_seconds(), cpu_seconds()
        wait_until(reaped.exists, 60, "the grandchild burning its 0.6 s and reaped by the child")
        t1, own1 = tree_cpu_seconds(), cpu_seconds()
        assert own1 - own0 < 0.3  # cpu_seconds sees no child until it is reaped here
        assert t1 - t0 >= 0.4  # the running child's waited-for grandchild
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds() >= t1  # reaped now: counted by cpu_seconds, not lost


def _stat_start_ticks(pid: int) -> int:
    """``/proc/PID/stat`` field 22 (the start, clock ticks after boot), read by hand."""
    return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_start_time_is_the_kernels_start_in_clock_ticks_and_none_for_no_process():
    from herald.procs import start_time

    child = subprocess.Popen(_python("import time; time.sleep(30)"))
    try:
        assert start_time(os.getpid()) == _stat_start_ticks(os.getpid())
        assert start_time(child.pid) == _stat_start_ticks(child.pid)
    finally:
        child.kill()
        child.wait()
    assert start_time(child.pid) is None  # reaped: gone
    assert start_time(2**22 + 1) is None  # above any pid_max


def test_is_zombie_and_is_alive_follow_a_child_until_it_is_reaped():
    from herald.procs import is_alive, is_zombie, start_time

    child = subprocess.Popen(_python("import sys; sys.stdin.read()"), stdin=subprocess.PIPE)
    start = start_time(child.pid)
    assert not is_zombie(child.pid) and is_alive(child.pid, start)
    assert not is_alive(child.pid, start + 1)  # the same pid with another start: a reused pid
    assert not is_alive(str(child.pid), start) and not is_alive(child.pid, None)
    child.stdin.close()  # it exits; not reaped yet: a zombie
    deadline = time.monotonic() + 30
    while not is_zombie(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert is_zombie(child.pid) and not is_alive(child.pid, start)
    child.wait()
    assert is_zombie(child.pid)  # gone


def test_seconds_since_start_is_the_uptime_minus_the_start():
    from herald.procs import seconds_since_start

    child = subprocess.Popen(_python("import time; time.sleep(30)"))
    try:
        for pid in (0, child.pid):
            got = seconds_since_start(pid)
            uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
            want = uptime - _stat_start_ticks(pid or os.getpid()) / os.sysconf("SC_CLK_TCK")
            assert abs(got - want) < 0.05  # /proc/uptime has 10 ms steps, the two readings a moment apart
    finally:
        child.kill()
        child.wait()
    assert seconds_since_start(child.pid) == 0.0
