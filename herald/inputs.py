"""What a user names on a command line, checked before any socket or process starts:
ZeroMQ endpoints, paths, numbers, and the host's memory.

NOTE [front doors] (docs/operations.md, "Bad input"): every ``herald`` command checks its
flags here (argparse ``type=`` callables, or the functions below from a command's
entry) before it opens a socket, starts a process or imports torch, so that bad input
ends at once with exit status 2 (a usage error: argparse's own error path, or
:class:`~herald.errors.UsageError`) or 1, and one line naming the flag, the value and the
fix; never a raw exception, never a wait without end.

- Endpoints (:func:`parse_endpoint`): ``tcp://HOST:PORT`` with a port in 1..65535 (``*``
  or 0: any free port, binds only), ``ipc://PATH`` whose folder exists (and whose path fits a
  Unix socket's 107 bytes); ``inproc://`` is refused (it lives inside one process, and
  every herald role is a process of its own), as is any other transport. Who may bind a
  non-loopback address is NOTE [transport security] (herald/auth.py: keys or
  ``--insecure``).
- Paths: an input (:func:`check_input_path`) must exist and be a file or a folder, never
  a FIFO, socket or device (reading one blocks, or never ends); an output folder
  (:func:`check_output_folder`) or file (:func:`check_output_file`) must be creatable:
  not a file or a device where a folder is wanted, its nearest existing folder writable
  and not in a kernel file system (``/proc``, ``/sys``) that takes no new files.
- Text files (:func:`read_text_file`): regular, at most a bound of bytes, UTF-8.

Plain Python (no numba, torch or zmq): ``herald`` builds its parser and checks its flags
in well under a second (herald/cli.py).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import socket
import stat
import time

from herald.errors import ConfigError

#: ``sun_path`` of a Unix socket holds 108 bytes, the last a NUL (Linux ``unix(7)``).
MAX_IPC_PATH_BYTES = 107
#: Largest integer a flag takes unless it says otherwise: a signed 64-bit int (ids, counts
#: and seeds all become numpy ``int64`` / ``uint64`` somewhere).
INT64_MAX = (1 << 63) - 1
#: Kernel file systems that take no new files or folders (``statfs(2)`` magic numbers are
#: not reachable from Python, so these are found by their mount points).
PSEUDO_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "securityfs", "debugfs", "tracefs", "configfs"})
_HOST = re.compile(r"[A-Za-z0-9_.\-*%]+|\[[0-9A-Fa-f:.%]+\]")


def _name(flag: str) -> str:
    return flag if flag.startswith("-") or " " in flag else f"--{flag}"


# ------------------------------------------------------------------ endpoints
def parse_endpoint(text: object, flag: str, *, bind: bool) -> str:
    """Check a ZeroMQ endpoint named by ``flag`` (NOTE [front doors]); returns it unchanged.

    Args:
        text: the endpoint; flag: its option (``--bind``), named in the error.
        bind: the role binds it (a ``*`` or 0 port allowed, the ipc folder must exist)
            rather than connects to it.

    Raises:
        ConfigError: a malformed endpoint, a port out of 1..65535, ``inproc://`` or
            another transport, an ipc folder that does not exist or a path too long.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{flag} must be a ZeroMQ endpoint such as tcp://127.0.0.1:5555, got {text!r}")
    value = f"{flag} {text!r:.120}"
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise ConfigError(f"{value} is not an endpoint: write tcp://HOST:PORT or ipc:///PATH")
    if scheme == "inproc":
        raise ConfigError(
            f"{value}: an inproc:// endpoint lives inside one process, and every herald role is a process "
            "of its own: use tcp://127.0.0.1:PORT or ipc:///PATH"
        )
    if scheme == "ipc":
        _check_ipc(rest, value, bind)
    elif scheme == "tcp":
        _check_tcp(rest.rsplit(";", 1)[-1], value, bind)
    else:
        raise ConfigError(f"{value}: transport {scheme}:// is not served; use tcp://HOST:PORT or ipc:///PATH")
    return text


def _check_tcp(rest: str, value: str, bind: bool) -> None:
    host, sep, port = rest.rpartition(":")
    if not sep or not host or _HOST.fullmatch(host) is None:
        raise ConfigError(f"{value}: expected tcp://HOST:PORT with a host name or address, e.g. tcp://127.0.0.1:5555")
    if port == "*" and bind:
        return
    if not port.isdigit() or not (0 if bind else 1) <= int(port) <= 65535:
        wanted = "0..65535, or * (or 0) for any free port" if bind else "1..65535"
        raise ConfigError(f"{value}: the port must be {wanted}, got {port!r:.20}")


def _check_ipc(path: str, value: str, bind: bool) -> None:
    if not path or "\0" in path:
        raise ConfigError(f"{value}: expected ipc:///PATH naming a socket file")
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ConfigError(
            f"{value}: a Unix socket path holds at most {MAX_IPC_PATH_BYTES} bytes, this one "
            f"{len(os.fsencode(path))}: use a shorter path (e.g. under /tmp)"
        )
    folder = os.path.dirname(path) or "."
    if bind and not os.path.isdir(folder):
        raise ConfigError(f"{value}: the folder {folder} does not exist; create it first or bind another path")


def endpoint_type(*, bind: bool, flag: str = "the endpoint"):
    """argparse ``type`` of an endpoint option (:func:`parse_endpoint`): a bad value is a usage error."""

    def parse(text: str) -> str:
        try:
            return parse_endpoint(text, flag, bind=bind)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(_without(str(exc), flag)) from None

    return parse


def add_bind_argument(p: argparse.ArgumentParser, default: str, *, note: str = "") -> None:
    """``--bind``, the endpoint a serving role (PS shard, dispatcher) binds, checked by
    :func:`endpoint_type`; ``note``: what the role adds to the help (e.g. its port rules)."""
    p.add_argument(
        "--bind",
        default=default,
        type=endpoint_type(bind=True, flag="--bind"),
        help=f"ZeroMQ endpoint to bind: tcp://HOST:PORT or ipc:///PATH ({note}another host's address needs "
        "--keys or --insecure) (default: %(default)s)",
    )


def _without(message: str, flag: str) -> str:
    """argparse prefixes ``argument FLAG:``; the message need not name the flag again."""
    return message[len(flag) + 1 :] if message.startswith(flag + " ") else message


def host_port(text: object, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (a Kafka broker, a Ray head) checked: a host and a port in 1..65535.

    Raises:
        ConfigError: naming ``flag``, the value and the form wanted.
    """
    if not isinstance(text, str):
        raise ConfigError(f"{flag} must be HOST:PORT, got {text!r}")
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not re.fullmatch(r"[A-Za-z0-9_.\-:]+", host) or not port.isdigit():
        raise ConfigError(f"{flag} {text!r:.80} is not HOST:PORT (e.g. 127.0.0.1:9092)")
    if not 1 <= int(port) <= 65535:
        raise ConfigError(f"{flag} {text!r:.80}: the port must be 1..65535, got {port}")
    return host, int(port)


def wait_listening(endpoint: str, timeout_s: float, *, every_s: float = 0.1) -> bool:
    """Whether something accepts connections at ``endpoint`` (``tcp://HOST:PORT`` or
    ``ipc://PATH``) within ``timeout_s`` seconds, trying every ``every_s``. Only the
    transport is tried (a TCP or Unix connection, closed at once), not ZeroMQ, so a
    listening ZeroMQ socket sees a peer that left during its greeting, nothing more.
    Another transport: True (not checked)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    scheme, _, rest = endpoint.partition("://")
    while True:
        left = deadline - time.monotonic()
        try:
            if scheme == "tcp":
                host, _, port = rest.rsplit(";", 1)[-1].rpartition(":")
                host = host[1:-1] if host.startswith("[") else host
                socket.create_connection((host, int(port)), timeout=max(0.05, min(1.0, left))).close()
            elif scheme == "ipc":
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(max(0.05, min(1.0, left)))
                    s.connect(rest)
            return True
        except (OSError, ValueError):
            if left <= 0:
                return False
            time.sleep(min(every_s, max(0.0, left)))


# ------------------------------------------------------------------ numbers
def int_type(low: int, high: int = INT64_MAX):
    """argparse ``type`` of an integer option in ``low..high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}, got {text!r:.40}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}, got {text:.40}")
        return value

    return parse


def float_type(span: str, check):
    """argparse ``type`` of a finite number passing ``check`` (``span`` says which, e.g. ``> 0``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not check(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text!r:.40}")
        return value

    return parse


# ------------------------------------------------------------------ paths
def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a file"),
    ):
        if test(mode):
            return name
    return "not a file"


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # a file in the path: its ancestors say which
        return None
    except OSError as exc:
        raise ConfigError(f"cannot look at {path}: {exc.strerror}") from None


def check_input_path(path: object, flag: str, *, folder_ok: bool = True) -> str:
    """An input a command reads: an existing file (or folder, with ``folder_ok``), never a
    FIFO, socket or device. Returns ``path``.

    Raises:
        ConfigError: missing, not readable, or of a kind that cannot be read to its end.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{flag} must be a path, got {path!r}")
    st = _stat(path)
    if st is None:
        raise ConfigError(f"{flag} {path}: no such file; check the path")
    kind = _kind(st.st_mode)
    if not (stat.S_ISREG(st.st_mode) or (folder_ok and stat.S_ISDIR(st.st_mode))):
        wanted = "a file or a folder" if folder_ok else "a file"
        raise ConfigError(f"{flag} {path} is {kind}, which cannot be read to its end: give {wanted}")
    if not os.access(path, os.R_OK | (os.X_OK if stat.S_ISDIR(st.st_mode) else 0)):
        raise ConfigError(f"{flag} {path} is not readable by this user; fix its permissions")
    return path


def _pseudo_mounts() -> list[str]:
    """Mount points of the :data:`PSEUDO_FILESYSTEMS` (from ``/proc/self/mounts``; none elsewhere)."""
    try:
        text = pathlib.Path("/proc/self/mounts").read_text()
    except OSError:
        return []
    points = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] in PSEUDO_FILESYSTEMS:
            points.append(parts[1].replace("\\040", " "))
    return points


def _existing_folder(path: str, flag: str) -> str:
    """The nearest existing ancestor of ``path`` (which does not exist), checked to be a
    writable folder outside the kernel's file systems."""
    absolute = os.path.abspath(path)
    parent = os.path.dirname(absolute)
    while True:
        st = _stat(parent)
        if st is not None:
            break
        parent = os.path.dirname(parent)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{flag} {path}: {parent} is {_kind(st.st_mode)}, not a folder; give another path")
    real = os.path.realpath(parent)
    for point in _pseudo_mounts():
        if point != "/" and (real == point or real.startswith(point.rstrip("/") + "/")):
            raise ConfigError(
                f"{flag} {path}: {point} is a kernel file system that takes no new files; give a path on a disk"
            )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the folder {parent} is not writable by this user; give another path")
    return parent


def check_output_folder(path: object, flag: str) -> str:
    """A folder a command writes into (made if missing): an existing writable folder, or
    a path whose nearest existing folder is writable and on a disk. Returns ``path``.

    Raises:
        ConfigError: a file, device or FIFO in its place, or a folder that cannot be made.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{flag} must be a folder path, got {path!r}")
    st = _stat(path)
    if st is None:
        _existing_folder(path, flag)
    elif not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{flag} {path} is {_kind(st.st_mode)}, not a folder; give a folder path")
    elif not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the folder is not writable by this user; give another path")
    return path


def check_output_file(path: object, flag: str, *, make_folder: bool = False) -> str:
    """A file a command writes: its folder exists (or can be made, with ``make_folder``) and
    is writable, and the path is not a folder, FIFO, socket or device. Returns ``path``.

    Raises:
        ConfigError: naming ``flag``, the path and the fix.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{flag} must be a file path, got {path!r}")
    st = _stat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{flag} {path} is {_kind(st.st_mode)}, not a file; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not make_folder and not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if st is None:
        _existing_folder(path, flag)
    elif not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path} is not writable by this user; fix its permissions or give another path")
    return path


def check_existing_folder(path: object, flag: str) -> str:
    """A folder that must already exist (a keys folder, a checkpoint root). Returns ``path``.

    Raises:
        ConfigError: missing, or not a folder.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{flag} must be a folder path, got {path!r}")
    st = _stat(path)
    if st is None:
        raise ConfigError(f"{flag} {path}: no such folder; create it first or fix the path")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{flag} {path} is {_kind(st.st_mode)}, not a folder; give a folder path")
    return path


def read_text_file(path: object, flag: str, *, max_bytes: int = 16 << 20) -> str:
    """The text of a small input file (a tables file, a token file): regular, at most
    ``max_bytes`` bytes, UTF-8.

    Raises:
        ConfigError: missing, of another kind, too large, unreadable or not UTF-8 text.
    """
    check_input_path(path, flag, folder_ok=False)
    size = os.stat(path).st_size
    if size > max_bytes:
        raise ConfigError(
            f"{flag} {path} holds {size} bytes, more than the {max_bytes} such a file may; check the path"
        )
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag} {path} is not UTF-8 text (byte {exc.start}); give a text file") from None


# ------------------------------------------------------------------ host
def host_memory_bytes() -> int:
    """Memory this host gives this process, in bytes: the physical memory, or the cgroup's
    ``memory.max`` (v2) / ``memory.limit_in_bytes`` (v1) when lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 16 << 30
    for name in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = pathlib.Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return int(total)
