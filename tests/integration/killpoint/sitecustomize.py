"""A test's kill point in a real PS shard process: loaded by every Python process that finds
this folder first on ``PYTHONPATH`` (``site`` imports ``sitecustomize``), it acts only in a
``herald serve ps --shard S`` process when ``HERALD_TEST_KILL_AT`` is set.

``HERALD_TEST_KILL_AT="S:OP:N"``: shard ``S`` SIGKILLs itself (a real ``kill -9``: no reply,
no flush, no cleanup) on the ``N``-th request of op ``OP`` it receives (1-based), before
handling it; ``OP`` ``after-checkpoint`` is the first request of any op after the ``N``-th
``checkpoint`` was answered (the dispatcher is committing that checkpoint then). Just before,
it writes ``{"unix_s": time of death, "op": ...}`` to ``HERALD_TEST_KILL_NOTE`` (a path), so
that a test can measure from the death; a shard started while that note exists (a rolled-back
attempt's) is not armed: one death per job. ``HERALD_TEST_OP_LOG`` (a path): each shard appends
``shard op`` per request received (to see the phases of a job).
"""

from __future__ import annotations

import os


def _argv() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _shard() -> int | None:
    argv = _argv()
    if "serve" not in argv or "ps" not in argv or "--shard" not in argv:
        return None
    try:
        return int(argv[argv.index("--shard") + 1])
    except (IndexError, ValueError):
        return None


def _install(shard: int) -> None:
    import json
    import signal
    import time

    import herald.ps.loop as loop
    from herald.ps.wire import PS

    spec = os.environ.get("HERALD_TEST_KILL_AT", "")
    target, op_at, nth = (spec.split(":") + ["", "", ""])[:3] if spec else ("", "", "0")
    note, op_log = os.environ.get("HERALD_TEST_KILL_NOTE"), os.environ.get("HERALD_TEST_OP_LOG")
    # once per job: a shard of a later attempt (a rollback's) finds the note and lives
    armed = spec != "" and int(target) == shard and not (note and os.path.exists(note))
    nth = int(nth or 0)
    seen: dict[str, int] = {}
    receive = loop.RequestLoop.receive

    def die(op: str) -> None:
        if note:
            tmp = note + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"unix_s": time.time(), "op": op, "shard": shard, "pid": os.getpid()}, f)
            os.replace(tmp, note)
        os.kill(os.getpid(), signal.SIGKILL)

    def patched(self, peer, frames):
        try:
            op = str(PS.unpack_header(frames[0]).get("op"))
        except Exception:
            op = "?"
        if op_log:
            with open(op_log, "a") as f:
                f.write(f"{shard} {op}\n")
        if armed:
            if op_at == "after-checkpoint" and seen.get("checkpoint", 0) >= nth:
                die(op)
            seen[op] = seen.get(op, 0) + 1
            if op == op_at and seen[op] == nth:
                die(op)
        return receive(self, peer, frames)

    loop.RequestLoop.receive = patched


_s = _shard()
if _s is not None and (os.environ.get("HERALD_TEST_KILL_AT") or os.environ.get("HERALD_TEST_OP_LOG")):
    _install(_s)
