"""Loader benchmark (same as ``herald bench loader``): samples/s of 4,096-sample
Criteo-shaped batches from Parquet, Criteo TSV, herald's ``HeraldIterableDataset``
through a torch DataLoader, and a plain torch DataLoader.

Run: ``python bench/bench_loader.py [--rows N] [--repeats R] [--quick]``.
See :mod:`herald.bench.loader` for what is measured.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from herald.bench.loader import main
from herald.bench.options import add_loader_arguments

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_loader_arguments(parser)
    sys.exit(main(parser.parse_args()))
