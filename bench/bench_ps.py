"""Benchmark of the PS (issue 4): pull / push throughput of one shard for 128-dim float32
rows, 1,000 and 10,000 keys per request, 1/2/4 client threads, next to a numpy memcpy
of the same bytes measured in the same run. Same as ``herald bench ps``.

    python bench/bench_ps.py [--seconds 0.3] [--repeats 3] [--transport tcp ipc]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from herald.bench.ps import main  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--keys", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--table-rows", type=int, default=200_000)
    p.add_argument("--transport", nargs="+", default=["tcp", "ipc"], choices=["tcp", "ipc"])
    sys.exit(main(p.parse_args()))
