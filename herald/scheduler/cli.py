"""``herald`` subcommands of :mod:`herald.scheduler`; see :mod:`herald.cli`.

- ``herald bench scheduler --data PATH_OR_URL --workers 8 --batch-size 128 --cache-ratio 0.1
  [--quality] [--scaling] [--memory-keys N] [--out DIR]``
"""

from __future__ import annotations


def _bench(args) -> int:
    from herald.scheduler.benchmark import main

    return main(args)


def register(commands, bench, serve) -> None:
    """Add this subpackage's parsers to the herald command groups."""
    from herald.scheduler.benchmark import add_bench_arguments

    p = bench.add_parser("scheduler", help="Herald Table 2: transmissions of vanilla/laia/plan/herald/costaware, "
                                           "scheduling time, quality vs brute force")
    add_bench_arguments(p)
    p.set_defaults(func=_bench)
