"""A child's death as its supervisor learns it, told to every process that waits on the child
(NOTE [death notices]).

NOTE [death notices]
~~~~~~~~~~~~~~~~~~~~
A PS shard that dies (``kill -9``, the OOM killer, a crash) answers nothing more, and a
process waiting on one of its replies would learn of the death only at that wait's deadline
(the PS client's ``--timeout-ms``: 120 s by default, NOTE [ps client deadline] in
herald/ps/link.py). The shard's supervisor knows at once, since the kernel tells a parent of
its child's end. One mechanism carries that to every wait on the shard, whichever process
waits:

1. **Watched.** The supervisor of PS shards (:class:`herald.ps.LocalShards`: ``herald
   train``'s, the tests'; a Ray role's actor, :class:`herald.job.ray.role.RoleHost`) runs
   its :class:`~herald.procs.Supervisor` with an :class:`ExitWatch`: one thread blocked on
   the children's pidfds (Linux >= 5.3; elsewhere it looks every :data:`FALLBACK_POLL_S`)
   that reaps a child the moment it ends and, unless the supervisor stopped it, calls
   ``on_death``, which records when (:meth:`~herald.procs.Supervisor.died_at`).
2. **Written down.** ``on_death`` writes the shard's notice beside its ipc socket
   (:func:`notice_path`: ``ipc://DIR/NAME.ipc`` -> ``DIR/NAME.dead``; JSON ``{"message",
   "unix_s"}``, mode 0600, renamed into place): the message names the shard, its address,
   its pid, how it ended (the signal) and the end of its log.
3. **Read while waiting.** Every :class:`~herald.ps.PSClient` of ipc shards checks the
   notices of its shards while it waits (:class:`NoticeCheck` as the link's ``liveness``: at
   least every 100 ms, each file at most every :data:`NOTICE_CHECK_S`), and a notice fails
   the wait at once with :class:`~herald.errors.PeerLost` carrying its message. So the
   dispatcher's admin ops (checkpoint staging, restore, stats), the workers' pulls, step
   messages and dense slices, their flush write-backs and the hybrid embedding worker's
   pushes all end within a fraction of a second of the death. The dispatcher's waits on
   its workers ask the job's liveness check about every 0.5 s (NOTE [ps liveness] in
   herald/ps/watch.py), which reads the same supervisor.

A notice lives in the shards' private folder, which is new for each attempt of a job
(NOTE [run leftovers] in herald/job/recovery/leftovers.py): it never outlives the shards it
names, and a shard restarted on its address has its notice removed first
(:meth:`herald.ps.LocalShards.restart`). Shards reached over TCP (other hosts) leave no
notice a client could read: they are named by their pings' silence (NOTE [ps liveness]) or,
under Ray, by their actor's death (:class:`herald.job.ray.parts.RayPS`).
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import psutil

from herald.errors import PeerLost
from herald.files import write_private

#: The suffix of a notice file, beside the ipc socket ``NAME.ipc`` of the peer it names.
NOTICE_SUFFIX = ".dead"
#: Each notice file is looked at no more often than this (s): a stat per shard per wait.
NOTICE_CHECK_S = 0.02
#: Without pidfds (not Linux, or Linux < 5.3) the exit watch looks this often (s).
FALLBACK_POLL_S = 0.05


def notice_path(address: str) -> pathlib.Path | None:
    """Where the notice of the peer bound at ``address`` lies: ``ipc://DIR/NAME.ipc`` ->
    ``DIR/NAME.dead``; None for any other transport (no file a client could read)."""
    if not address.startswith("ipc://"):
        return None
    path = pathlib.Path(address[len("ipc://") :])
    return path.with_name(path.stem + NOTICE_SUFFIX) if path.suffix == ".ipc" else None


def write_notice(path: str | os.PathLike, message: str, unix_s: float) -> None:
    """Write the notice ``{"message", "unix_s"}`` (when the death was seen, Unix seconds) at
    ``path``, mode 0600, complete or not at all (written beside it, then renamed).

    Raises:
        StorageError: it cannot be written (names why and the fix).
    """
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_private(tmp, json.dumps({"message": message, "unix_s": round(unix_s, 3)}), "death notice", sync=False)
    os.replace(tmp, path)


def read_notice(path: str | os.PathLike) -> dict | None:
    """The notice at ``path`` (``{"message": str, "unix_s": float}``), or None when there is
    none; one that cannot be parsed still names a death (its message says so)."""
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return None
    try:
        notice = json.loads(text)
        if isinstance(notice, dict) and isinstance(notice.get("message"), str):
            return notice
    except ValueError:
        pass
    return {"message": f"the peer of {path} died (its death notice is unreadable)", "unix_s": None}


class NoticeCheck:
    """A :class:`~herald.ps.link.ShardLink` ``liveness`` check: ``check(shard)`` raises
    :class:`~herald.errors.PeerLost` (the notice's message) when a notice names one of the
    shards at ``addresses`` (NOTE [death notices], 3.). Non-blocking; each file is looked at
    no more often than :data:`NOTICE_CHECK_S`.

    Args:
        addresses: the shards' endpoints, index = shard number (non-ipc ones are never checked).
        op: what the waits are (the error's ``op``).
    """

    def __init__(self, addresses: Sequence[str], op: str = "request"):
        self.addresses, self.op = list(addresses), op
        self._paths = [notice_path(a) for a in self.addresses]
        self._next = [0.0] * len(self._paths)

    @classmethod
    def of(cls, addresses: Sequence[str]) -> NoticeCheck | None:
        """A check of ``addresses``, or None when none of them can leave a notice (no ipc)."""
        check = cls(addresses)
        return check if any(p is not None for p in check._paths) else None

    def __call__(self, shard: int) -> None:
        path = self._paths[shard]
        now = time.monotonic()
        if path is None or now < self._next[shard]:
            return
        self._next[shard] = now + NOTICE_CHECK_S
        if not os.path.exists(path):
            return
        notice = read_notice(path)
        if notice is not None:
            raise PeerLost(notice["message"], peer=self.addresses[shard], op=self.op, unix_s=notice.get("unix_s"))


class ExitWatch:
    """One daemon thread calling ``on_exit(key)`` as soon as a process :meth:`add` ed ends
    (NOTE [death notices], 1.): it blocks on the processes' pidfds, or without them looks
    every :data:`FALLBACK_POLL_S`. ``on_exit`` runs on that thread, once per process; an error
    it raises is printed, not raised (the thread goes on). :meth:`close` ends the thread.

    Args:
        on_exit: called with the key of each process that ended.
        name: the thread's name.
    """

    def __init__(self, on_exit: Callable[[Hashable], None], name: str = "herald-exit-watch"):
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._fds: dict[int, Hashable] = {}  # pidfd -> key
        self._polled: dict[int, Hashable] = {}  # pid -> key, without pidfds
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, pid: int, key: Hashable) -> None:
        """Watch process ``pid`` (a child of this process, not yet reaped by anyone else)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._fds[os.pidfd_open(pid)] = key
            except (AttributeError, OSError):  # no pidfds here: look at it every FALLBACK_POLL_S
                self._polled[pid] = key
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                fds, polled = dict(self._fds), dict(self._polled)
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll(FALLBACK_POLL_S * 1000 if polled else None)}
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            ended = [fd for fd in fds if fd in ready]
            with self._lock:
                for fd in ended:
                    self._fds.pop(fd, None)
                    os.close(fd)
                gone = [pid for pid in polled if _ended(pid)]
                for pid in gone:
                    self._polled.pop(pid, None)
            for key in [fds[fd] for fd in ended] + [polled[pid] for pid in gone]:
                try:
                    self._on_exit(key)
                except Exception as exc:  # the watch goes on: the waits' own deadlines remain
                    print(f"herald: the exit watch's handler failed: {type(exc).__name__}: {exc}", flush=True)

    def close(self) -> None:
        """End the thread (joined for at most 1 s) and close the pidfds; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(1.0)
        if self._thread.is_alive():  # stuck in a handler: leave it its descriptors (a daemon thread)
            return
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _ended(pid: int) -> bool:
    """Whether child ``pid`` has ended (a zombie, or gone), without reaping it."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True
