"""The rendezvous store of a multi-host torchrun job, on the dispatcher host.

    python -m herald.testbed.store --host 10.200.7.2 --port 29400 [--ready-file F]

Serves a ``torch.distributed.TCPStore`` until SIGTERM / SIGINT. Every worker host's
torchrun joins it with ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-conf
is_host=false``: the rendezvous then lives on a host that is not a worker, so it does
not depend on which worker host starts first (torchrun's c10d backend otherwise makes
the node whose address matches the endpoint host the store).
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import threading
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m herald.testbed.store", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", required=True, help="address to serve on (this host's address on the bed)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ready-file", default=None, help="write HOST:PORT here once serving")
    args = p.parse_args(argv)
    from torch.distributed import TCPStore

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    if args.ready_file:
        tmp = pathlib.Path(args.ready_file).with_suffix(".tmp")
        tmp.write_text(f"{args.host}:{args.port}\n")
        tmp.replace(args.ready_file)
    print(f"rendezvous store on {args.host}:{args.port}", flush=True)
    while not stop.wait(1.0):
        pass
    del store
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
