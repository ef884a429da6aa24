"""The test bed's network: addresses, link shaping, and the ``ip`` / ``tc`` calls.

NOTE [test bed network]: every host is a network namespace ``hb-<uid>-<host>`` with
``lo`` up and one interface ``eth0`` holding ``10.A.B.<i+1>/24``; ``eth0`` is one end
of a veth pair whose other end, ``port<i>``, sits on the bridge ``br0`` of a switch
namespace ``hb-<uid>-switch``. Both ends are created inside their namespaces, so the
machine's own namespace never sees a new interface, address or route. Each host link
is shaped in both directions by the egress qdisc of its two ends: ``tbf`` for the rate,
under a ``netem`` root for the delay when ``delay_ms > 0``. A packet from host to host
crosses two links: one-way latency ``2 x delay_ms``, round trip ``4 x delay_ms``, and
each host sends and receives at most ``rate``.

NOTE [test bed delay]: a fixed per-packet delay needs the kernel's ``netem`` qdisc;
no other qdisc adds one (``tbf``'s ``latency`` only bounds its queue, ``ip route ...
rtt`` only seeds TCP's estimate), and kernels without loadable modules often lack it
(checked on one: ``tbf``, ``htb``, ``red``, ``pfifo``/``bfifo`` and ``clsact`` present;
``netem``, ``prio``, ``fq``, ``fq_codel``, ``cake`` and every tc classifier absent). So
a delay left to its default (``None``) is :data:`DEFAULT_DELAY_MS` where the bed's
switch namespace can hold a ``netem`` qdisc, else 0 with a one-line warning and a note
that the benchmark records (:func:`resolve_delay`); a delay asked for explicitly on a
kernel without ``netem`` is an error naming the fix.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Iterable, Sequence

from herald.errors import ConfigError, HeraldError

#: longest wait for one ``ip`` / ``tc`` command, seconds
COMMAND_TIMEOUT_S = 10.0
#: one-way delay per link and direction when none is asked for and netem exists, ms
DEFAULT_DELAY_MS = 0.2
_NETEM_FIX = (
    "load it (modprobe sch_netem; on Ubuntu it is in linux-modules-extra-$(uname -r)), or run without "
    "a delay (delay_ms=0 / --delay 0, or leave the delay out: the default then drops it with a "
    "warning); tbf shapes the rate alone"
)

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_BITS_PER_UNIT = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}


class TestBedError(HeraldError):
    """The test bed cannot be built or used here (not root, ``ip``/``tc`` or a qdisc
    missing, a command failed). The message names the fix."""

    __test__ = False  # not a pytest test class


def rate_bits_per_s(rate: str) -> float:
    """Bits per second of a tc rate such as ``"1gbit"``, ``"100mbit"`` or ``"125mbps"``
    (SI units, as tc reads them: ``kbit`` = 1000 bit/s, ``mbps`` = 8e6 bit/s).

    Raises:
        ConfigError: not a positive rate in those units.
    """
    m = _RATE.match(str(rate).strip())
    value = float(m.group(1)) * _BITS_PER_UNIT[m.group(2).lower()] if m else 0.0
    if not m or not math.isfinite(value) or value < 8000:
        raise ConfigError(
            f"rate must be a tc rate of at least 8kbit such as '1gbit', '100mbit' or '125mbps', got {rate!r}"
        )
    return value


def check_tools(shaping: bool) -> None:
    """Raise :class:`TestBedError` naming the fix when this process cannot build a bed:
    not root, or ``ip`` (iproute2) missing, or ``tc`` missing while ``shaping``."""
    if os.geteuid() != 0:
        raise TestBedError(
            "the test bed creates network namespaces and needs root: run as root (sudo -E ...), as CI does"
        )
    for tool, needed in (("ip", True), ("tc", shaping)):
        if needed and shutil.which(tool) is None:
            raise TestBedError(f"'{tool}' is not on PATH: install iproute2 (apt-get install iproute2)")


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ``ip`` / ``tc`` command, bounded by :data:`COMMAND_TIMEOUT_S`.

    Raises:
        TestBedError: it failed (``check``) or timed out; the message holds its stderr.
    """
    try:
        done = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise TestBedError(f"`{' '.join(argv)}` did not finish within {COMMAND_TIMEOUT_S:.0f} s") from None
    if check and done.returncode != 0:
        raise TestBedError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def choose_subnet(uid: str, taken: Iterable[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0 - 10.249.255.0 that overlaps nothing in ``taken`` (the
    machine's addresses and routes, other live beds), first candidate derived from ``uid``.

    Raises:
        TestBedError: every candidate is taken.
    """
    taken = list(taken)
    start = zlib.crc32(uid.encode()) % (50 * 256)
    for k in range(50 * 256):
        i = (start + k) % (50 * 256)
        net = ipaddress.IPv4Network(f"10.{200 + i // 256}.{i % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise TestBedError(
        "no free 10.200-249.x.0/24 subnet for the test bed: remove stale beds (python -m herald.testbed cleanup)"
    )


def machine_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this namespace's addresses and routes (to stay clear of)."""
    nets = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for line in run(argv, check=False).stdout.splitlines():
            for word in line.split():
                if re.match(r"^\d+\.\d+\.\d+\.\d+(/\d+)?$", word):
                    try:
                        nets.append(ipaddress.IPv4Network(word, strict=False))
                    except ValueError:
                        pass
    return [n for n in nets if n.prefixlen > 0]


def shape_commands(namespace: str, device: str, rate: str | None, delay_ms: float) -> list[list[str]]:
    """The ``tc`` commands that shape ``device``'s egress in ``namespace`` (NOTE [test bed
    network]): ``netem delay`` at the root when ``delay_ms > 0``, ``tbf`` below it (or at
    the root) when ``rate`` is given. The tbf bucket holds 1 ms at the rate (at least
    128 KiB: a veth sends 64 KiB segments) and queues up to 20 ms."""
    add = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
    cmds, parent = [], ["root", "handle", "1:"]
    if delay_ms > 0:
        cmds.append([*add, *parent, "netem", "delay", f"{delay_ms:g}ms", "limit", "100000"])
        parent = ["parent", "1:1", "handle", "10:"]
    if rate is not None:
        burst = max(128 * 1024, int(rate_bits_per_s(rate) / 8 / 1000))
        cmds.append([*add, *parent, "tbf", "rate", rate, "burst", str(burst), "latency", "20ms"])
    return cmds


def has_qdisc(namespace: str, kind: str, device: str = "lo") -> bool:
    """Whether the kernel gives ``device`` in ``namespace`` a ``kind`` qdisc (``netem``):
    adds one at the root with its plainest settings, then removes it. Needs root.

    Raises:
        TestBedError: ``tc`` itself failed or timed out.
    """
    args = {"netem": ["delay", "1ms"]}.get(kind, [])
    done = run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", kind, *args], check=False)
    if done.returncode == 0:
        run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
        return True
    if "unknown" in done.stderr.lower():
        return False
    raise TestBedError(
        f"cannot tell whether the kernel has the '{kind}' qdisc: `tc qdisc add ... {kind}` "
        f"failed: {done.stderr.strip()}"
    )


def resolve_delay(requested_ms: float | None, netem: bool) -> tuple[float, str]:
    """The one-way delay per link a bed uses, and a note when it differs from the
    default (NOTE [test bed delay]).

    Args:
        requested_ms: the delay asked for, ms; None: the default, :data:`DEFAULT_DELAY_MS`
            where ``netem`` exists. netem: whether the kernel has the ``netem`` qdisc.

    Returns:
        ``(delay_ms, note)``: ``note`` is ``""``, or one sentence saying the default
        delay was dropped because the kernel has no ``netem``.

    Raises:
        TestBedError: a delay > 0 asked for explicitly and no ``netem``; the message
            names the fix.
    """
    if requested_ms is None:
        if netem:
            return DEFAULT_DELAY_MS, ""
        return 0.0, (
            f"this kernel has no netem qdisc, so the links have no delay (the default "
            f"{DEFAULT_DELAY_MS:g} ms is dropped; a rate is still shaped, by tbf); for a delay load "
            f"sch_netem (modprobe sch_netem; on Ubuntu it is in linux-modules-extra-$(uname -r))"
        )
    if requested_ms > 0 and not netem:
        raise TestBedError(
            f"a delay of {requested_ms:g} ms needs the kernel's netem qdisc, which this kernel lacks: {_NETEM_FIX}"
        )
    return float(requested_ms), ""


def apply_shaping(namespace: str, device: str, rate: str | None, delay_ms: float) -> None:
    """Run :func:`shape_commands`.

    Raises:
        TestBedError: a qdisc is missing from the kernel (netem is a module of its own:
            ``sch_netem``); the message says how to load it or to run without a delay.
    """
    for cmd in shape_commands(namespace, device, rate, delay_ms):
        done = run(cmd, check=False)
        if done.returncode == 0:
            continue
        kind = "netem" if "netem" in cmd else "tbf"
        if "unknown" in done.stderr.lower():
            fix = _NETEM_FIX if kind == "netem" else "load it (modprobe sch_tbf), or run without shaping (rate=None)"
            raise TestBedError(f"this kernel has no '{kind}' qdisc (`{' '.join(cmd)}`: {done.stderr.strip()}): {fix}")
        raise TestBedError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
