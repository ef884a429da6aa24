"""``herald`` subcommands of :mod:`herald.ps`; see :mod:`herald.cli`.

- ``herald serve ps --shard I --num-shards N [--bind tcp://127.0.0.1:PORT] [--tables tables.json]
  [--seed S] [--ready-file F]``: one shard process (SIGTERM or a shutdown request stops it).
- ``herald bench ps``: pull/push throughput against one shard next to a numpy memcpy.
"""

from __future__ import annotations

import pathlib


def _serve(args) -> int:
    from herald.ps.config import tables_from_json
    from herald.ps.server import run_shard

    from herald.errors import ConfigError

    tables = []
    if args.tables:
        try:
            text = pathlib.Path(args.tables).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the tables file {args.tables}: {exc}") from None
        tables = tables_from_json(text)
    return run_shard(args.shard, args.num_shards, args.bind, tables, args.seed, args.ready_file)


def _bench(args) -> int:
    from herald.ps.bench import main as bench_main

    return bench_main(args)


def register(commands, bench, serve) -> None:
    """Add this subpackage's parsers to the herald command groups."""
    p = serve.add_parser("ps", help="run one embedding parameter-server shard")
    p.add_argument("--shard", type=int, required=True, help="this shard's index in [0, num-shards)")
    p.add_argument("--num-shards", type=int, required=True, help="total number of shards")
    p.add_argument("--bind", default="tcp://127.0.0.1:*",
                   help="ZeroMQ endpoint to bind (loopback by default; '*' port = any free port)")
    p.add_argument("--tables", default=None, help="JSON file: list of table declarations (docs/ps.md)")
    p.add_argument("--seed", type=int, default=0, help="initialiser seed, equal on every shard")
    p.add_argument("--ready-file", default=None, help="write the bound endpoint here once serving")
    p.set_defaults(func=_serve)

    b = bench.add_parser("ps", help="PS pull/push throughput vs numpy memcpy (one shard)")
    b.add_argument("--dim", type=int, default=128, help="embedding dimension (float32)")
    b.add_argument("--keys", type=int, nargs="+", default=[1000, 10000], help="keys per request")
    b.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="client threads")
    b.add_argument("--seconds", type=float, default=0.3, help="measuring time per round")
    b.add_argument("--repeats", type=int, default=3, help="rounds per configuration (median reported)")
    b.add_argument("--transport", nargs="+", default=["tcp", "ipc"], choices=["tcp", "ipc"],
                   help="ZeroMQ transports to measure")
    b.add_argument("--table-rows", type=int, default=200_000, help="distinct keys in the table")
    b.add_argument("--out", default="runs/bench-ps.json", help="JSON file for the results (default: %(default)s)")
    b.set_defaults(func=_bench)
