"""A multi-host test bed on one machine: network namespaces as hosts, a bridge, shaped links.

:class:`TestBed` builds the network of NOTE [test bed network] (:mod:`herald.testbed.links`),
starts processes inside a host (:meth:`TestBed.run`) and tears everything down on
:meth:`~TestBed.close`, on ``with``-block exit, at interpreter exit and on SIGTERM /
SIGHUP (NOTE [test bed teardown]). :func:`cleanup_stale` removes what a crashed run
left. It needs root, ``ip`` and (when links are shaped) ``tc``.

NOTE [test bed teardown]: (1) every child started by :meth:`TestBed.run` gets SIGTERM,
then SIGKILL after a grace period; (2) every process still inside one of the bed's
namespaces (``ip netns pids``: the children's process groups, torchrun's workers, a
daemon that left its group; nothing started in a host can leave its namespace) gets
SIGKILL, and the bed waits until none is left, so only processes of the bed are ever
signalled;
(3) the namespaces are deleted, which destroys their veth pairs and the bridge;
(4) the bed's state file (``/run/herald-testbed/<uid>.json``: owner pid, start time,
namespaces) is removed. Each step is bounded; the whole takes at most
``teardown_timeout_s`` plus a few ``ip`` commands. A bed whose owner died without
teardown (SIGKILL) is found by its state file (owner gone) and removed by
:func:`cleanup_stale`, which every new bed runs first.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import math
import os
import pathlib
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from herald.errors import ConfigError
from herald.procs import Supervisor, is_alive, is_zombie, start_time
from herald.testbed import links

PREFIX = "hb-"
SWITCH = "switch"
STATE_DIR = pathlib.Path("/run/herald-testbed")
_HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,19}$")


@dataclass(frozen=True)
class Host:
    """One host of a bed: its namespace, its address on the bed's /24 and its interface."""

    name: str
    namespace: str
    address: str
    interface: str = "eth0"


class TestBed:
    """N hosts (network namespaces) on one bridge, each link shaped (NOTE [test bed network]).

    Args:
        hosts: host names, e.g. ``["ps", "dispatcher", "worker0", "worker1"]``: lowercase
            letters, digits and ``-``, at most 20 characters, unique, not ``switch``.
        rate: each host link's rate in both directions, a tc rate (``"1gbit"``,
            ``"100mbit"``); None: not shaped.
        delay_ms: each host link's one-way delay in each direction, milliseconds (needs
            the ``netem`` qdisc); host to host is two links: ``2 x delay_ms`` one way.
            None (default): ``links.DEFAULT_DELAY_MS`` (0.2) where the kernel has
            ``netem``, else 0 with a warning line on stderr (NOTE [test bed delay]).
        log_dir: folder of the logs of the processes started with :meth:`run`
            (``<name>.log``, kept); None: ``$TMPDIR/herald-testbed-<uid>`` (removed at
            :meth:`close` when nothing was logged).
        teardown_timeout_s: bound on stopping the processes at :meth:`close`.

    Attributes:
        uid: 6 hex digits naming this bed (``hb-<uid>-<host>``); hosts: ``{name: Host}``
            (filled by :meth:`open`); subnet: the bed's ``10.A.B.0/24``; delay_ms: the
            delay in effect (None until :meth:`open` resolves the default); delay_note:
            why the default delay was dropped (``""`` when it was not); log_dir: the
            logs' folder (made at :meth:`open`); pids_seen:
            every process id the bed started or found in its namespaces at teardown.

    Raises:
        ConfigError: bad hosts, rate or delay. TestBedError (from :meth:`open`): not
            root, a tool or qdisc missing (also: ``delay_ms > 0`` without ``netem``), a
            command failed; the bed is torn down first.

    Use as a context manager; :meth:`close` is idempotent and bounded (NOTE [test bed teardown]).
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        rate: str | None = "1gbit",
        delay_ms: float | None = None,
        log_dir: str | os.PathLike | None = None,
        teardown_timeout_s: float = 30.0,
    ):
        names = list(hosts)
        bad = [h for h in names if not isinstance(h, str) or not _HOST_NAME.match(h) or h == SWITCH]
        if not names or bad or len(set(names)) != len(names) or len(names) > 250:
            raise ConfigError(
                f"hosts must be 1..250 unique names of lowercase letters, digits and '-' "
                f"(at most 20, not {SWITCH!r}), got {names!r}"
            )
        if rate is not None:
            links.rate_bits_per_s(rate)
        if delay_ms is not None and not (
            isinstance(delay_ms, (int, float)) and math.isfinite(delay_ms) and 0 <= delay_ms <= 10_000
        ):
            raise ConfigError(f"delay_ms must be a number in [0, 10000] or None (the default), got {delay_ms!r}")
        if not (teardown_timeout_s > 0):
            raise ConfigError(f"teardown_timeout_s must be > 0, got {teardown_timeout_s!r}")
        self.names, self.rate = names, rate
        self.delay_ms = None if delay_ms is None else float(delay_ms)
        self.delay_note = ""
        self.teardown_timeout_s = float(teardown_timeout_s)
        self.uid = secrets.token_hex(3)
        self._own_log_dir = log_dir is None  # a temporary folder, made at open: removed at close if empty
        self.log_dir = (
            pathlib.Path(log_dir)
            if log_dir is not None
            else pathlib.Path(tempfile.gettempdir()) / f"herald-testbed-{self.uid}"
        )
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.pids_seen: set[int] = set()
        self._children: Supervisor | None = None
        self._state = "new"  # new -> open -> closed
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ building
    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the bed: the hosts', then the switch's."""
        return [self.namespace(h) for h in self.names] + [self.namespace(SWITCH)]

    def namespace(self, host: str) -> str:
        return f"{PREFIX}{self.uid}-{host}"

    def address(self, host: str) -> str:
        """``host``'s IPv4 address on the bed.

        Raises:
            ConfigError: no such host (or the bed is not open).
        """
        return self._host(host).address

    def _host(self, host: str) -> Host:
        if host not in self.hosts:
            raise ConfigError(
                f"no host {host!r} in this test bed (hosts: {list(self.hosts) or self.names}; open the bed first)"
            )
        return self.hosts[host]

    def open(self) -> TestBed:
        """Build the namespaces, the bridge and the shaped links.

        Raises:
            TestBedError: see the class; on any failure the bed is torn down first.
        """
        if self._state != "new":
            raise ConfigError("a TestBed opens once; make a new one")
        links.check_tools(shaping=self.rate is not None or self.delay_ms != 0)
        cleanup_stale()
        self._state = "open"
        _LIVE.add(self)
        _install_handlers()
        try:
            self.subnet = links.choose_subnet(self.uid, links.machine_networks() + _live_subnets())
            _write_state(
                self.uid,
                {
                    "pid": os.getpid(),
                    "start": start_time(os.getpid()),
                    "namespaces": self.namespaces,
                    "subnet": str(self.subnet),
                },
            )
            self._build()
            self._children = Supervisor(self.log_dir, new_session=True)  # makes log_dir
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        sw = self.namespace(SWITCH)
        links.run(["ip", "netns", "add", sw])
        for cmd in (
            ["link", "set", "lo", "up"],
            ["link", "add", "br0", "type", "bridge"],
            ["link", "set", "br0", "up"],
        ):
            links.run(["ip", "-n", sw, *cmd])
        self._resolve_delay(sw)
        hosts = list(self.subnet.hosts())
        for i, name in enumerate(self.names):
            ns, port = self.namespace(name), f"port{i}"
            host = Host(name, ns, str(hosts[i]))
            links.run(["ip", "netns", "add", ns])
            links.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            links.run(
                ["ip", "link", "add", host.interface, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw]
            )
            links.run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            links.run(["ip", "-n", ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.interface])
            links.run(["ip", "-n", ns, "link", "set", host.interface, "up"])
            links.apply_shaping(ns, host.interface, self.rate, self.delay_ms)
            links.apply_shaping(sw, port, self.rate, self.delay_ms)
            self.hosts[name] = host

    def _resolve_delay(self, probe_namespace: str) -> None:
        """Fix :attr:`delay_ms` (NOTE [test bed delay]): probe ``netem`` in the switch
        namespace when a delay may be needed; warn once when the default is dropped."""
        netem = self.delay_ms == 0 or links.has_qdisc(probe_namespace, "netem")
        self.delay_ms, self.delay_note = links.resolve_delay(self.delay_ms, netem)
        if self.delay_note:
            print(f"herald test bed: warning: {self.delay_note}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ processes
    def run(
        self, host: str, argv: Sequence[str], *, name: str | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (``ip netns exec``) in a session of its own,
        stdout and stderr to ``log_dir/<name>.log`` (see :meth:`log_path`).

        Args:
            host: a host of the bed. argv: the command (an absolute program path is
                safest, e.g. ``sys.executable``). name: the child's name in logs and
                errors (default ``<host>-<n>``). env: variables set on top of this
                process's environment.

        Raises:
            ConfigError: unknown host, name in use, or the bed is not open.
        """
        if self._state != "open" or self._children is None:
            raise ConfigError("the test bed is not open: use it inside `with TestBed(...) as bed:`")
        ns = self._host(host).namespace
        name = name or f"{host}-{len(self._children.procs)}"
        prefix = ["ip", "netns", "exec", ns]
        if env:
            prefix += ["env", *[f"{k}={v}" for k, v in env.items()]]
        proc = self._children.start(name, [*prefix, *map(str, argv)])
        self.pids_seen.add(proc.pid)
        return proc

    def empty_hosts(self, hosts: Sequence[str], timeout_s: float = 10.0) -> set[int]:
        """SIGKILL every process still inside ``hosts`` (e.g. workers a stopped torchrun
        left), until none is left or ``timeout_s``; returns their pids. Used between two
        attempts of a job (NOTE [test bed failover] in herald/testbed/job.py).

        Raises:
            ConfigError: an unknown host, or the bed is not open.
        """
        if self._state != "open":
            raise ConfigError("the test bed is not open: use it inside `with TestBed(...) as bed:`")
        seen = _empty_namespaces([self._host(h).namespace for h in hosts], time.monotonic() + timeout_s)
        self.pids_seen |= seen
        return seen

    @property
    def children(self) -> Supervisor:
        """The :class:`~herald.procs.Supervisor` of the processes :meth:`run` started
        (``failure()``, ``tail(name)``, ``terminate(name)``)."""
        if self._children is None:
            raise ConfigError("the test bed is not open")
        return self._children

    def log_path(self, name: str) -> pathlib.Path:
        """The log file of child ``name``."""
        return self.log_dir / f"{name}.log"

    def exec(self, host: str, argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run a short command inside ``host`` and return its result (text stdout/stderr).

        Raises:
            ConfigError: unknown host. subprocess.TimeoutExpired: it ran past ``timeout_s``.
        """
        return subprocess.run(
            ["ip", "netns", "exec", self._host(host).namespace, *map(str, argv)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    # ------------------------------------------------------------------ teardown
    def close(self, timeout_s: float = 30.0) -> None:
        """Tear the bed down (NOTE [test bed teardown]) within ``timeout_s`` or the bed's
        ``teardown_timeout_s``, the smaller, plus a few ``ip`` commands; idempotent."""
        with self._lock:
            state, self._state = self._state, "closed"
        if state != "open":  # closed already, or never opened: nothing was built
            return
        bound_s = max(0.0, min(timeout_s, self.teardown_timeout_s))
        try:
            if self._children is not None:
                self._children.close(timeout_s=min(10.0, bound_s))
            deadline = time.monotonic() + bound_s
            self.pids_seen |= _empty_namespaces(self.namespaces, deadline)
            _delete_namespaces(self.namespaces)
            left = [ns for ns in list_namespaces() if ns in self.namespaces]
            if left:
                print(
                    f"herald test bed: warning: could not delete {left}; remove them with "
                    "`python -m herald.testbed cleanup`",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                _state_file(self.uid).unlink(missing_ok=True)
            if self._own_log_dir and self.log_dir.is_dir() and not any(self.log_dir.iterdir()):
                self.log_dir.rmdir()
        finally:
            _LIVE.discard(self)
            if not _LIVE:
                _restore_handlers()

    def __enter__(self) -> TestBed:
        return self.open() if self._state == "new" else self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        """One line per host: name, namespace, address; and the links' shaping."""
        delay = "default" if self.delay_ms is None else f"{self.delay_ms:g} ms"
        shaping = f"rate {self.rate or 'unshaped'}, delay {delay} per link and direction"
        return "\n".join(
            [f"test bed {self.uid} on {self.subnet} ({shaping}); logs in {self.log_dir}"]
            + [f"  {h.name:<12} {h.address:<15} ip netns exec {h.namespace} ..." for h in self.hosts.values()]
        )


# ---------------------------------------------------------------------- stale beds
def cleanup_stale(*, everything: bool = False) -> list[str]:
    """Remove the ``hb-*`` namespaces of beds whose owner process is gone (a run that
    was killed before its teardown), killing the processes inside them first.

    Args:
        everything: also remove beds whose owner is alive (only when no run is going on).

    Returns:
        The namespaces removed.
    """
    by_uid: dict[str, list[str]] = {}
    for ns in list_namespaces():  # before the owners: a bed writes its state file before its namespaces
        by_uid.setdefault(ns[len(PREFIX) :].split("-", 1)[0], []).append(ns)
    owners = {}
    for path in STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else ():
        try:
            owners[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            owners[path.stem] = {}
    removed = []
    for uid in set(by_uid) | set(owners):
        state = owners.get(uid, {})
        if not everything and is_alive(state.get("pid"), state.get("start")):
            continue
        names = by_uid.get(uid, [])
        _empty_namespaces(names, time.monotonic() + 5.0)
        _delete_namespaces(names)
        _state_file(uid).unlink(missing_ok=True)
        removed += names
    return removed


def beds_of(pid: int) -> dict[str, list[str]]:
    """``{uid: namespaces}`` of the beds whose state file names process ``pid`` as owner
    and that still exist (e.g. a test session checking that it left nothing behind)."""
    out = {}
    for path in STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else ():
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and state.get("pid") == pid:
            out[path.stem] = [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}{path.stem}-")]
    return out


def list_namespaces() -> list[str]:
    """The ``hb-*`` network namespaces on this machine."""
    out = links.run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _empty_namespaces(namespaces: Sequence[str], deadline: float) -> set[int]:
    """SIGKILL every process inside ``namespaces`` until none is left or ``deadline``."""
    seen: set[int] = set()
    while True:
        pids = {
            int(p)
            for ns in namespaces
            for p in links.run(["ip", "netns", "pids", ns], check=False).stdout.split()
            if p.isdigit()
        }
        pids = {p for p in pids if not is_zombie(p)}
        seen |= pids
        if not pids or time.monotonic() > deadline:
            return seen
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def _delete_namespaces(namespaces: Sequence[str]) -> None:
    existing = set(list_namespaces())
    for ns in namespaces:
        if ns in existing:
            links.run(["ip", "netns", "del", ns], check=False)


def _state_file(uid: str) -> pathlib.Path:
    return STATE_DIR / f"{uid}.json"


def _write_state(uid: str, state: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = _state_file(uid).with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(_state_file(uid))


def _live_subnets() -> list[ipaddress.IPv4Network]:
    nets = []
    for path in STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else ():
        try:
            nets.append(ipaddress.IPv4Network(json.loads(path.read_text())["subnet"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return nets


# ---------------------------------------------------------------------- exit and signals
_LIVE: set[TestBed] = set()
_SAVED: dict[int, object] = {}
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _close_all() -> None:
    for bed in list(_LIVE):
        bed.close()


def _on_signal(signum, frame) -> None:
    """Tear every live bed down, then do what the signal did before (default: end the
    process with that signal, so the exit status tells)."""
    _close_all()
    old = _SAVED.get(signum, signal.SIG_DFL)
    _restore_handlers()
    if callable(old):
        old(signum, frame)
    elif old != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    if _SAVED or threading.current_thread() is not threading.main_thread():
        return
    for sig in _SIGNALS:
        _SAVED[sig] = signal.signal(sig, _on_signal)


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, old in list(_SAVED.items()):
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, old)
        del _SAVED[sig]


atexit.register(_close_all)
