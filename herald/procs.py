"""Child processes of the launchers (``herald train``'s workers, ``LocalShards``' PS shards).

:class:`Supervisor` starts named children, each logging to its own file, tells which one
died (with the end of its log), and stops them all within a bound. :func:`core_plan` and
:func:`pin_to_cores` pin co-located processes to cores of their own (``herald train
--pin-cores``). :func:`start_time` and :func:`is_alive` tell whether a process recorded
earlier (a pid and its start time) still runs. What the kernel says about a process (its
start, state, CPU times, threads) is read through ``psutil``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import psutil

from herald.deaths import ExitWatch
from herald.errors import ConfigError, HeraldError

_REAP_S = 2.0  # after SIGKILL: how long to wait for the kernel to reap a child
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc's times (and of start_time)
_BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)  # seconds since boot, as /proc/uptime


def cpu_seconds() -> float:
    """CPU seconds (user + sys) of this process and of every child it has waited for.

    The difference of two readings, taken before a job starts and after its processes
    (PS shards, workers) exited and were reaped, is the whole job's CPU time: what
    ``herald bench scale`` divides by the samples trained (``cpu_us_per_sample``).
    Children still running are not counted yet (the kernel adds a child at its reaping).
    """
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def tree_cpu_seconds() -> float:
    """:func:`cpu_seconds` plus the CPU seconds of every descendant still running (user +
    sys, with what each has waited for: ``psutil``'s ``cpu_times()``, on Linux /proc's
    ``utime stime cutime cstime``). Two readings taken while a job runs give the CPU of
    every local process of the job between them, children that exit in between included
    once they are reaped (NOTE [steady cpu] in herald/job/runner.py)."""
    total = cpu_seconds()
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        return total
    for proc in descendants:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # it exited meanwhile
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@contextlib.contextmanager
def startup_garbage_frozen() -> Iterator[None]:
    """Set up a long-running role without the cyclic garbage collector, then freeze every
    object so far and turn the collector on (NOTE [start-up garbage]). A role's command
    disables the collector before its imports too (``herald serve worker``)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


# NOTE [start-up garbage]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A worker's start (importing torch; then the process group, the model, the optimizer, whose
# first construction imports torch._dynamo) allocates so many objects that the cyclic
# collector ran four full (generation 2) collections during it, 100-150 ms each, 0.23-0.26 s
# per worker of a 2-core job. Nothing of that set-up is garbage, so ``herald serve worker``
# starts with the collector off and, once set up, ``gc.freeze()``s every object it has: later
# full collections (rare, but due whenever enough objects survive) no longer walk those
# hundreds of thousands of objects, and a worker paused by one would hold back every rank of
# a synchronous step. The training loop runs with the collector on (its own garbage is collected
# as before: about one young collection every two steps, 0.1 ms each).


# NOTE [no code from the current folder]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every role is a Python child (``python -m herald serve ps|worker``, torchrun's workers, the
# test bed's services). ``python -m`` and ``python -c`` put the current folder first on the
# import path, so a ``herald.py`` or ``herald/`` in the folder a job was started from would
# run, as the job's user, inside every shard and worker. Children therefore start with
# ``PYTHONSAFEPATH=1`` (Python >= 3.11: the current folder is never added to ``sys.path``),
# set by :func:`child_env` in the one place children are started (:class:`Supervisor`, which
# the test bed's ``ip netns exec`` children also go through); the variable is inherited, so
# torchrun's own children are covered too. herald itself is found where it is installed (or
# through ``PYTHONPATH``, which stays honoured).
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child role: this process's, NOTE [no code from the current
    folder]'s ``PYTHONSAFEPATH=1``, then ``extra`` on top."""
    return {**os.environ, **SAFE_PATH_ENV, **(extra or {})}


def die_with_parent() -> None:
    """``preexec_fn`` for a child process: SIGKILL it when its parent dies.

    Uses Linux's ``prctl(PR_SET_PDEATHSIG)``, so a ``herald train`` killed with
    ``kill -9`` leaves no orphan PS shards or workers. Where prctl is missing the
    call does nothing; the children's own peer timeouts then end them.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _seconds_after_boot(pid: int) -> float | None:
    """When process ``pid`` started, in seconds after boot, or None when there is no such process."""
    try:
        created = psutil.Process(pid).create_time()  # seconds after boot + the boot's epoch time
    except (psutil.Error, ValueError, TypeError):
        return None
    return created - psutil.boot_time()


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22),
    or None when there is no such process. With the pid it names one process: a pid the
    kernel reused belongs to a process with another start time."""
    seconds = _seconds_after_boot(pid)
    return None if seconds is None else round(seconds * _CLOCK_TICKS)


def seconds_since_start(pid: int = 0) -> float:
    """How long ago process ``pid`` (0: this one) started, in seconds (the time since boot,
    ``CLOCK_BOOTTIME`` as ``/proc/uptime``, minus its start; 0.0 where that is unknown)."""
    seconds = _seconds_after_boot(pid or os.getpid())
    return 0.0 if seconds is None else max(0.0, time.clock_gettime(_BOOT_CLOCK) - seconds)


def signal_words(code: int) -> str:
    """``"signal 9 (SIGKILL)"`` for the exit code ``-9`` of a process a signal ended."""
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def is_zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped, or gone)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.Error, ValueError, TypeError):
        return True


def is_alive(pid: object, start: object) -> bool:
    """Whether the process recorded as ``pid`` with :func:`start_time` ``start`` still runs
    on this host (False for a pid that is not an int, and for a reused pid)."""
    return isinstance(pid, int) and start is not None and start_time(pid) == start and not is_zombie(pid)


def core_plan(n_processes: int, available: Sequence[int]) -> list[list[int]]:
    """The cores of each of ``n_processes`` processes sharing the cores ``available``.

    With no more processes than cores, each gets a contiguous block of ``available`` (in
    its order) of its own, the blocks' sizes differing by at most one (the first ones are
    the larger): 8 cores, 3 processes -> ``[[0, 1, 2], [3, 4, 5], [6, 7]]``. With more
    processes than cores each gets one core, round-robin (process ``i`` on
    ``available[i % len(available)]``), so some share one: 2 cores, 3 processes ->
    ``[[0], [1], [0]]``.

    Args:
        n_processes: >= 1. available: core numbers (e.g. ``sorted(os.sched_getaffinity(0))``),
            at least one, each once.

    Returns:
        ``n_processes`` lists of core numbers (ints).

    Raises:
        ConfigError: ``n_processes`` < 1, or ``available`` empty or with repeats.
    """
    cores = [int(c) for c in available]
    if n_processes < 1:
        raise ConfigError(f"core_plan needs at least one process, got {n_processes}")
    if not cores or len(set(cores)) != len(cores):
        raise ConfigError(f"core_plan needs distinct available cores, got {list(available)!r}")
    if n_processes > len(cores):
        return [[cores[i % len(cores)]] for i in range(n_processes)]
    size, extra = divmod(len(cores), n_processes)
    plan, start = [], 0
    for i in range(n_processes):
        end = start + size + (i < extra)
        plan.append(cores[start:end])
        start = end
    return plan


def pin_to_cores(cores: Iterable[int], pid: int = 0) -> None:
    """Pin every thread of process ``pid`` (0: this process) to ``cores`` (Linux).

    ``os.sched_setaffinity(tid)`` sets the mask of one thread, and a thread takes its
    creator's mask only when it is created; so each thread ``psutil`` lists (``/proc/PID/task``)
    is set, and the listing is read again until it shows no thread not yet set (threads
    started meanwhile). A thread that ends meanwhile is skipped, and so is a process that
    is gone (its supervisor names it).

    Raises:
        OSError: a core this process may not use (``EINVAL``), or no permission on ``pid``.
    """
    mask = {int(c) for c in cores}
    done: set[int] = set()
    while True:
        try:
            tids = {t.id for t in psutil.Process(pid or os.getpid()).threads()} - done
        except psutil.NoSuchProcess:  # the process is gone
            return
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, mask)
            except ProcessLookupError:  # the thread ended
                pass
        done |= tids


def _child_setup(cores: Sequence[int] | None) -> Callable[[], None]:
    """``preexec_fn`` of a child: :func:`die_with_parent`, then pinned to ``cores`` (None:
    not pinned). It runs in the child before ``exec``, while the child has one thread, so
    the mask is every later thread's (a worker's torch threads, its numba threads)."""

    def setup() -> None:
        die_with_parent()
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return setup


class Supervisor:
    """Named child processes, each writing stdout and stderr to ``log_dir/<name>.log``.

    Children die with this process (:func:`die_with_parent`) and read nothing from stdin.
    A child's first start truncates its log; a restart under the same name appends to it.
    A child that exits with a non-zero code is a failure (:meth:`check`, :meth:`failure`)
    unless this supervisor ended it (:meth:`kill`, :meth:`terminate`, :meth:`stop` of a
    running child).

    Args:
        log_dir: folder of the logs (created if missing).
        env: variables set for every child on top of this process's environment.
        new_session: start each child in a session of its own, so that a Ctrl-C at the
            terminal reaches only this process, which then stops the children itself.
        on_death: ``on_death(name)``, called from an :class:`~herald.deaths.ExitWatch` thread
            the moment a child ends without this supervisor stopping it (reaped, its
            :meth:`exit_status` and :meth:`died_at` set: NOTE [death notices] in
            herald/deaths.py); None: no watch, a death is seen when :meth:`failure` looks.

    Used by ``herald train`` (workers: :func:`herald.job.launcher.run_train`) and
    :class:`herald.ps.LocalShards`; exercised in tests/test_procs.py.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
        on_death: Callable[[str], None] | None = None,
    ):
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.new_session = bool(new_session)
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopped: set[str] = set()
        self._died: dict[str, float] = {}  # name -> when its death was seen (Unix seconds)
        self._on_death = on_death
        self._watch = ExitWatch(self._exited, name="herald-supervisor") if on_death is not None else None
        self._closed = False

    # ---------------------------------------------------------------- start
    def log_path(self, name: str) -> pathlib.Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str, argv: Sequence[str], *, cores: Sequence[int] | None = None) -> subprocess.Popen:
        """Start ``argv`` as child ``name`` (a finished child's name may be reused: a restart),
        pinned to ``cores`` from its start when given (``os.sched_setaffinity``; None: the
        cores of this process).

        Raises:
            ConfigError: ``name`` is still running, or the supervisor is closed.
        """
        if self._closed:
            raise ConfigError(f"cannot start {name}: the supervisor is closed")
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise ConfigError(f"{name} is already running (pid {old.pid}); stop it before starting it again")
        with open(self.log_path(name), "ab" if old is not None else "wb") as log:
            self.procs[name] = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(self.env),
                start_new_session=self.new_session,
                preexec_fn=_child_setup(cores),
            )
        self._stopped.discard(name)
        self._died.pop(name, None)
        if self._watch is not None:
            self._watch.add(self.procs[name].pid, (name, self.procs[name]))
        return self.procs[name]

    def _exited(self, key: tuple[str, subprocess.Popen]) -> None:
        """The exit watch saw child ``key`` end: reap it and, when it is still the child of that
        name and this supervisor did not stop it, record when and call ``on_death``."""
        name, p = key
        _reap(p)
        if self.procs.get(name) is p and self.exit_status(name) is not None:
            self._died.setdefault(name, time.time())
            self._on_death(name)

    # ---------------------------------------------------------------- liveness
    def tail(self, name: str, lines: int = 15) -> str:
        """The last ``lines`` lines of ``name``'s log (``"(no log)"`` if unreadable)."""
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def exit_status(self, name: str) -> str | None:
        """How child ``name`` ended (``"was killed by signal 9 (SIGKILL)"``, ``"exited with code 1"``,
        ``"exited with code 0"``) when it ended without this supervisor stopping it; None
        while it runs, after a stop by this supervisor, or for an unknown name."""
        p = self.procs.get(name)
        code = None if p is None else p.poll()
        if code is None or name in self._stopped:
            return None
        return f"was killed by {signal_words(code)}" if code < 0 else f"exited with code {code}"

    def died_at(self, name: str) -> float | None:
        """When child ``name``'s end was first seen (Unix seconds; with ``on_death``, the moment
        it ended), while :meth:`exit_status` names it; None otherwise."""
        if self.exit_status(name) is None:
            return None
        return self._died.setdefault(name, time.time())

    def failure(self, grace_s: float = 0.0) -> str | None:
        """A message naming the child that failed, with the end of its log, waiting up to
        ``grace_s`` for one to exit; None when none did. A child killed by a signal is named
        before one that exited with an error: the error is often the echo of that death
        (a peer's all-reduce failing when its partner is gone)."""
        deadline = time.monotonic() + grace_s
        while True:
            failed = [
                (name, how)
                for name in self.procs
                if (how := self.exit_status(name)) is not None and how != "exited with code 0"
            ]
            if failed:
                name, how = min(failed, key=lambda f: "signal" not in f[1])  # stable: first killed, else first
                return f"{name} {how}; last lines of {self.log_path(name)}:\n{self.tail(name)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def check(self) -> None:
        """Raise :class:`HeraldError` naming the first child that exited with an error."""
        failure = self.failure()
        if failure:
            raise HeraldError(failure)

    def wait(self, timeout_s: float, *, context: str = "") -> None:
        """Wait up to ``timeout_s`` in all for every child to exit, then :meth:`check`.

        Raises:
            HeraldError: a child is still running at the deadline (named, ``context``
                appended to the message), or one exited with an error.
        """
        deadline = time.monotonic() + timeout_s
        for name, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise HeraldError(
                    f"{name} did not exit within {timeout_s:.0f} s{context}; last lines of "
                    f"{self.log_path(name)}:\n{self.tail(name)}"
                ) from None
        self.check()

    # ---------------------------------------------------------------- stop
    def kill(self, name: str) -> None:
        """SIGKILL child ``name`` (no shutdown: a crash) and reap it."""
        p = self.procs[name]
        if p.poll() is None:
            self._stopped.add(name)
            p.kill()
            _reap(p)

    def terminate(self, name: str, timeout_s: float = 5.0) -> int | None:
        """SIGTERM child ``name`` (graceful), SIGKILL after ``timeout_s``; returns its exit code."""
        p = self.procs.get(name)
        if p is None:
            return None
        if p.poll() is None:
            self._stopped.add(name)
            _term(p)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                _reap(p)
        return p.returncode

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every child still running: SIGTERM, then SIGKILL at ``timeout_s``; bounded
        by about ``timeout_s`` plus a short reap."""
        for name, p in self.procs.items():
            if p.poll() is None:
                self._stopped.add(name)
                _term(p)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                _reap(p)

    def close(self, timeout_s: float = 5.0) -> None:
        """:meth:`stop`, once; later calls do nothing (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.stop(timeout_s)
        if self._watch is not None:
            self._watch.close()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _term(p: subprocess.Popen) -> None:
    """SIGTERM, then SIGCONT: a stopped child (SIGSTOP, a debugger) acts on it at once."""
    p.terminate()
    try:
        p.send_signal(signal.SIGCONT)
    except OSError:  # already gone
        pass


def _reap(p: subprocess.Popen) -> None:
    try:
        p.wait(_REAP_S)
    except subprocess.TimeoutExpired:  # stuck in the kernel (uninterruptible I/O): give up
        pass
