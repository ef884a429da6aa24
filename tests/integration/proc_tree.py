"""The live child processes of a process, read from /proc (for tests that kill one role)."""

from __future__ import annotations

import pathlib


def children(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every process whose parent is ``pid``."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if ppid == pid:
            out.append((int(stat.parent.name), cmd))
    return out
