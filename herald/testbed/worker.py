"""torchrun's entry on a worker host: ``herald serve worker`` with the rank and world
size torchrun hands out (``RANK``, ``WORLD_SIZE`` in the environment).

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint 10.200.7.2:29400 --local-addr 10.200.7.3 \
        -m herald.testbed.worker --dispatcher tcp://10.200.7.2:5555 [herald serve worker options]

``herald serve worker`` takes ``--rank`` and ``--world-size`` as options, which a
torchrun command line cannot fill: with c10d rendezvous the ranks are known only once
every node has joined. This entry fills them and runs the very same command (the
dense process group then rendezvouses through torchrun's store: ``env://``).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``herald serve worker --rank $RANK --world-size $WORLD_SIZE ARGV``.

    Returns:
        The command's exit status; 2 when not started by torchrun (no ``RANK`` /
        ``WORLD_SIZE``), or when ``ARGV`` holds ``--rank`` / ``--world-size`` itself.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    rank, world_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        print("herald.testbed.worker: error: RANK and WORLD_SIZE are not set: start it with torchrun "
              "(or run `herald serve worker --rank R --world-size N` directly)", file=sys.stderr)
        return 2
    if any(a.split("=", 1)[0] in ("--rank", "--world-size") for a in argv):
        print("herald.testbed.worker: error: torchrun sets the rank and world size; drop --rank / --world-size",
              file=sys.stderr)
        return 2
    from herald.cli import main as herald_main

    return herald_main(["serve", "worker", "--rank", rank, "--world-size", world_size, *argv])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
