"""``herald`` subcommands of :mod:`herald.ps`; see :mod:`herald.cli`.

- ``herald serve ps --shard I --num-shards N [--bind tcp://127.0.0.1:PORT] [--tables tables.json]
  [--seed S] [--ready-file F] [--max-keys-per-request K] [--max-dim D] [--max-table-bytes B]
  [--max-contributors C] [--aggregation-timeout-ms T] [--max-rows R] [--max-shard-bytes B]
  [--max-tables T] [--keys DIR | --insecure]
  [--checkpoint-root DIR] [--token-file FILE]``: one shard process (SIGTERM or a
  shutdown request carrying its admin token stops it); the ``--max-*`` options are NOTE
  [ps limits] (docs/ps.md); ``--keys``/``--insecure`` NOTE [transport security]
  (herald/auth.py); ``--checkpoint-root`` and the token (``--token-file`` or the
  ``HERALD_PS_TOKEN`` environment variable, never an option value) NOTE [ps admin ops].
"""

from __future__ import annotations

import pathlib

from herald.contracts.tables import tables_from_json
from herald.errors import ConfigError
from herald.ps.admin import load_token
from herald.ps.config import ShardLimits


def _serve(args) -> int:
    from herald.ps.server import run_shard  # on use: the herald parser must not load numba (herald/cli.py)

    tables = []
    if args.tables:
        try:
            text = pathlib.Path(args.tables).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the tables file {args.tables}: {exc}") from None
        tables = tables_from_json(text)
    limits = ShardLimits(**{name: getattr(args, name) for name in _LIMITS})
    return run_shard(
        args.shard,
        args.num_shards,
        args.bind,
        tables,
        args.seed,
        args.ready_file,
        limits,
        keys_dir=args.keys,
        insecure=args.insecure,
        checkpoint_root=args.checkpoint_root,
        admin_token=load_token(args.token_file),
    )


_LIMITS = {
    "max_keys_per_request": "keys in one pull/push request (PSClient splits larger operations)",
    "max_dim": "largest embedding dim a table may declare",
    "max_table_bytes": "largest row array of one table on this shard, bytes",
    "max_contributors": "largest contributors value and bound on rank (set it to the job's workers)",
    "aggregation_timeout_ms": "abort an aggregation still open this long after its step opened",
    "max_rows": "rows one table holds at most; least recently used rows beyond it are evicted (0: no bound)",
    "max_shard_bytes": "memory of all tables on this shard together, bytes (rows allocated, with their key-map "
    "and bookkeeping share)",
    "max_tables": "tables this shard accepts (at most 65536)",
}


def shard_args(
    shard: int,
    num_shards: int,
    bind: str,
    *,
    seed: int = 0,
    tables_file: str | None = None,
    ready_file: str | None = None,
    keys_dir: str | None = None,
    insecure: bool = False,
    checkpoint_root: str | None = None,
    limits: ShardLimits | None = None,
) -> list[str]:
    """The arguments after the interpreter that start shard ``shard`` of ``num_shards``
    (``-m herald serve ps ...``): the one builder of this command line, used by
    :class:`herald.ps.LocalShards`, the Ray launcher and the test bed. Every limit of
    ``limits`` (NOTE [ps limits]; None: the defaults) is passed, so the shard enforces
    what its starter computed.
    """
    limits = limits if limits is not None else ShardLimits()
    return [
        "-m", "herald", "serve", "ps",
        "--shard", str(shard), "--num-shards", str(num_shards), "--bind", bind, "--seed", str(seed),
        *(["--tables", str(tables_file)] if tables_file else []),
        *(["--ready-file", str(ready_file)] if ready_file else []),
        *(["--keys", str(keys_dir)] if keys_dir else []),
        *(["--insecure"] if insecure and not keys_dir else []),
        *(["--checkpoint-root", str(checkpoint_root)] if checkpoint_root else []),
        *[a for name, v in limits.to_dict().items() for a in ("--" + name.replace("_", "-"), str(v))],
    ]  # fmt: skip


def register(commands, bench, serve) -> None:
    """Add this subpackage's parsers to the herald command groups."""
    p = serve.add_parser("ps", help="run one embedding parameter-server shard")
    p.add_argument("--shard", type=int, required=True, help="this shard's index in [0, num-shards)")
    p.add_argument("--num-shards", type=int, required=True, help="total number of shards")
    p.add_argument(
        "--bind",
        default="tcp://127.0.0.1:*",
        help="ZeroMQ endpoint to bind (loopback by default; '*' port = any free port)",
    )
    p.add_argument("--tables", default=None, help="JSON file: list of table declarations (docs/ps.md)")
    p.add_argument("--seed", type=int, default=0, help="initialiser seed, equal on every shard")
    p.add_argument("--ready-file", default=None, help="write the bound endpoint here once serving")
    p.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CURVE keys folder (herald keys generate DIR): answer only clients holding its client key, "
        "encrypt all traffic; needed to bind a non-loopback address",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="bind a non-loopback address without keys (unauthenticated, unencrypted; warns)",
    )
    p.add_argument(
        "--checkpoint-root",
        default=None,
        metavar="DIR",
        help="checkpoint and restore only to folders inside DIR (default: both refused)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="file (mode 600) holding the admin token that checkpoint, restore and shutdown requests "
        "must carry (default: the HERALD_PS_TOKEN environment variable; none: shutdown refused)",
    )
    defaults = ShardLimits()
    for name, text in _LIMITS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=getattr(defaults, name),
            help=f"{text} (NOTE [ps limits]; default: %(default)s)",
        )
    p.set_defaults(func=_serve)
