"""Scheduler benchmark (same as ``herald bench scheduler``): Herald's Table 2 (pull, push and
total reduction vs vanilla for laia, plan, herald and costaware), scheduling time per global
batch, and optionally brute-force quality, scaling and snapshot memory.

Run: ``python bench/bench_scheduler.py --data ../shared/data/movielens/ml-latest-small/ratings.csv
--workers 8 --batch-size 128 --cache-ratio 0.1``. See :mod:`herald.scheduler.benchmark`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from herald.scheduler.benchmark import add_bench_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_bench_arguments(parser)
    sys.exit(main(parser.parse_args()))
