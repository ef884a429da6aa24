"""The options of ``herald bench device`` (:mod:`herald.bench.device`): argparse only, as
:mod:`herald.bench.options` (which re-exports them for :mod:`herald.bench.cli`)."""

from __future__ import annotations

import argparse


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``herald bench device`` (``--section`` and what follows it: a section's
    child, run by the command itself)."""
    p.add_argument("--out", default=None, metavar="DIR", help="where device.json, summary.txt and logs/ go")
    p.add_argument("--smoke", action="store_true", help="every section at tiny sizes (about a minute on 2 cores)")
    p.add_argument(
        "--wheels",
        default=None,
        metavar="DIR",
        help="install the wheels of scripts/device_wheels.sh from DIR first (no registry needed)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for every section together; a section past it is not started (default: 480, --smoke 1200)",
    )
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=2000, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--gpu-batch-sizes", type=int, nargs="+", default=[256], help=argparse.SUPPRESS)
