"""Benchmark of the worker cache's hot path (issue 16): lookup + backward + fused sparse
update, ours (numba) vs FBGEMM's CPU table-batched embeddings, one thread, same run.
Same as ``herald bench kernels``.

    python bench/bench_kernels.py [--dims 16 64] [--bags 1 8] [--rows-per-table 10000 200000] \
        [--reps 30] [--out runs/bench-kernels.json]
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # before numba loads
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from herald.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
