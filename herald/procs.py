"""Child-process helpers shared by the launchers (``herald train``, ``LocalShards``)."""

from __future__ import annotations

import signal


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
