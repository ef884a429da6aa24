"""Run a few system calls as another local user, for tests of what that user may reach."""

from __future__ import annotations

import os
from collections.abc import Callable

NOBODY = 65534


def as_nobody(action: Callable[[], str]) -> str:
    """``action()`` run as user nobody in a forked child: the string it returns. Root passes
    every permission check, and the venv's python lives under /root, so a new interpreter
    could not start as nobody: the child is a fork, and ``action`` may make system calls
    only (the parent's threads, ZeroMQ's among them, did not survive the fork)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, action().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(pid, 0)
    return said
