"""End-to-end benchmark, herald vs vanilla (see herald/worker/bench.py); same as `herald bench e2e`.

    python bench/bench_e2e.py [--rows 200000] [--workers 2 4] [--out runs/bench-e2e]
"""

import sys

from herald.worker.bench import main

if __name__ == "__main__":
    sys.exit(main())
