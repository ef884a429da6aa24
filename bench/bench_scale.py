"""Scaling benchmark, herald with 1, 2, 4, ... workers vs plain PyTorch (see herald/bench/scale.py);
same as `herald bench scale`.

    python bench/bench_scale.py [--rows 1200000] [--max-workers N] [--schedules vanilla herald] [--out scale.json]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from herald.bench.scale import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
