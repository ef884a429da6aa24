"""One role of a Ray job (a PS shard or a worker) on the Ray node that Ray placed it on.

:class:`RoleHost` is the body of the Ray actor of one role (NOTE [ray job] in
herald/job/ray/parts.py): it runs the role's ``python -m herald serve ps|worker`` command
line as a child process, as :class:`herald.job.parts.LocalPS` and
:class:`~herald.job.parts.LocalWorkers` do on one host (a :class:`~herald.procs.Supervisor`:
the child dies with the actor, its log is ``<name>.log`` in the run folder), so the roles'
protocol code is the same under every launcher. What the role needs on its node (the
tables file, its half of the keys, its ready file, its ipc socket) is written into a
private folder of the node (mode 0700, files 0600) that :meth:`RoleHost.stop` removes.

A plain class: :mod:`herald.job.ray.parts` makes it an actor (``ray.remote(RoleHost)``)
when a job starts, so importing this module does not import Ray. Every method returns at
once but :meth:`RoleHost.stop` (bounded): the actor runs one call at a time on its main
thread, the thread that starts the child (``PR_SET_PDEATHSIG`` follows the thread that
forked: :func:`herald.procs.die_with_parent`).
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import socket
import struct
import sys
import tempfile

from herald.deaths import notice_path, write_notice
from herald.errors import StorageError
from herald.files import private_dir, write_private
from herald.procs import Supervisor

#: ``SIOCGIFADDR`` (linux/sockios.h): an interface's IPv4 address.
_SIOCGIFADDR = 0x8915
#: Where the launcher's token for the run folder check lies in the run folder (NOTE [ray job]).
RUN_CHECK_FILE = ".ray-run-check"
#: The marker a role's command line uses for its private folder (:meth:`RoleHost.start`).
FOLDER = "{folder}"


class RoleHost:
    """Runs one role ``name`` (``ps-shard-0``, ``worker-1``) of a job as a child process.

    Args:
        name: the role's name; its log is ``log_dir/<name>.log``.
        log_dir: the job's run folder (the same folder on every node: NOTE [ray job]).
    """

    def __init__(self, name: str, log_dir: str):
        self.name, self.log_dir = name, log_dir
        self.children: Supervisor | None = None
        self.folder: pathlib.Path | None = None
        self._notice: pathlib.Path | None = None  # a PS shard's death notice (NOTE [death notices])

    # ------------------------------------------------------------------ the node
    def node(self, ip: str) -> dict:
        """Where this role runs, ``ip`` being its Ray node's address: ``{"hostname", "pid",
        "ifname"}`` (``ifname``: the network interface holding ``ip``, for gloo; None when
        none is found)."""
        return {"hostname": socket.gethostname(), "pid": os.getpid(), "ifname": interface_of(ip)}

    def check_run_folder(self, token: str) -> str | None:
        """None when the run folder (``log_dir``) of this node is the launcher's: its
        :data:`RUN_CHECK_FILE` holds ``token``; else what this node sees there."""
        path = pathlib.Path(self.log_dir) / RUN_CHECK_FILE
        try:
            seen = path.read_text().strip()
        except OSError as exc:
            return f"cannot read {path}: {exc.strerror or exc}"
        return None if seen == token else f"{path} holds another job's token"

    def free_port(self) -> int:
        """A TCP port free on this node now (torchrun's way to pick ``MASTER_PORT``)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    # ------------------------------------------------------------------ the child
    def start(self, args: list[str], env: dict[str, str], files: dict[str, bytes], prefix: str) -> dict:
        """Write ``files`` (path relative to a fresh private folder -> bytes, each 0600) into
        a private folder ``<TMPDIR>/<prefix>XXXX`` of this node (0700) and start ``python
        ARGS`` (this actor's interpreter), where :data:`FOLDER` in any argument stands for
        that folder, with ``env`` on top of this actor's environment. Returns ``{"pid", "folder"}``.

        Raises:
            ConfigError: a role is already running here.
        """
        if self.children is None:
            self.children = Supervisor(self.log_dir, new_session=True, on_death=self._on_death)
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix=prefix))  # mode 0700
        for rel, data in files.items():
            path = self.folder / rel
            private_dir(path.parent)
            write_private(path, data, "role file", sync=False)
        # herald importable in the child as in this actor (a source checkout that is not installed)
        root = str(pathlib.Path(__file__).resolve().parents[2])
        self.children.env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        argv = [a.replace(FOLDER, str(self.folder)) for a in args]
        self._notice = notice_path(argv[argv.index("--bind") + 1]) if "--bind" in argv[:-1] else None
        proc = self.children.start(self.name, [sys.executable, *argv])
        return {"pid": proc.pid, "folder": str(self.folder)}

    def _on_death(self, name: str) -> None:
        """The child ended on its own: a PS shard bound on ipc gets its death notice beside its
        socket (NOTE [death notices]), naming it, its node, how it ended and its log's end."""
        failure = self.children.failure() if self.children is not None else None
        if self._notice is None or failure is None:
            return
        where = f"{name} (pid {self.children.procs[name].pid} on {socket.gethostname()})"
        try:
            write_notice(self._notice, failure.replace(name, where, 1), self.children.died_at(name) or 0.0)
        except StorageError as exc:  # the launcher still sees the death at its next check
            print(f"herald: {exc}", file=sys.stderr, flush=True)

    def read(self, rel: str) -> str | None:
        """The text of file ``rel`` of the private folder (a PS shard's ready file: its bound
        address), or None while it is not there."""
        if self.folder is None:
            return None
        try:
            return (self.folder / rel).read_text().strip() or None
        except OSError:
            return None

    def poll(self) -> int | None:
        """The child's exit code (negative: killed by that signal), None while it runs (or
        before it started)."""
        proc = self.children.procs.get(self.name) if self.children is not None else None
        return None if proc is None else proc.poll()

    def failure(self) -> str | None:
        """How the child ended, with the end of its log, when it ended on its own with an
        error (:meth:`herald.procs.Supervisor.failure`); None otherwise."""
        return self.children.failure() if self.children is not None else None

    def exit_status(self) -> str | None:
        """How the child ended when it ended on its own (exit code 0 included), else None."""
        return self.children.exit_status(self.name) if self.children is not None else None

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Stop the child (SIGTERM, SIGKILL after ``timeout_s``) and remove the private
        folder; returns the child's exit code. Idempotent, bounded by about ``timeout_s``."""
        code = None
        if self.children is not None:
            self.children.close(timeout_s)
            code = self.poll()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        return code


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is ``ip`` (for
    ``GLOO_SOCKET_IFNAME``), or None (no such interface, or not IPv4)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None
