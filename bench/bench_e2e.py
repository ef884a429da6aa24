"""End-to-end benchmark, herald vs vanilla (see herald/bench/e2e.py); same as `herald bench e2e`.

python bench/bench_e2e.py [--rows 200000] [--workers 2 4] [--out runs/bench-e2e]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from herald.bench.e2e import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
