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

import re

from herald.auth import check_bind
from herald.contracts.tables import tables_from_json
from herald.errors import ConfigError, UsageError
from herald.inputs import (
    INT64_MAX,
    add_bind_argument,
    check_existing_folder,
    check_output_file,
    int_type,
    read_text_file,
)
from herald.ps.admin import load_token
from herald.ps.config import MAX_SHARDS, MAX_TABLES, ShardLimits, host_shard_bytes


def _serve(args) -> int:
    tables, limits, token = _checked(args)  # NOTE [front doors]: every flag before any socket, and before numba
    from herald.ps.server import run_shard  # on use: the herald parser must not load numba (herald/cli.py)

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
        admin_token=token,
    )


def _checked(args) -> tuple[list, ShardLimits, str | None]:
    """``herald serve ps``'s flags checked together (NOTE [front doors] in herald/inputs.py):
    the tables file, the limits (``--max-dim`` by default the widest table's dim, so the
    socket's frame bound follows the job's tables: :func:`~herald.ps.config.largest_frame_bytes`),
    the paths, the bind policy and the token. Returns ``(tables, limits, token)``.

    Raises:
        UsageError: ``--shard`` not below ``--num-shards``. ConfigError: any other bad input.
    """
    if args.shard >= args.num_shards:
        raise UsageError(f"--shard {args.shard} must be below --num-shards {args.num_shards} (shards are 0..N-1)")
    tables = []
    if args.tables is not None:
        tables = tables_from_json(read_text_file(args.tables, "--tables"), where=f"--tables {args.tables}")
    given = {name: getattr(args, name) for name in _LIMITS if getattr(args, name) is not None}
    if tables and "max_dim" not in given:
        given["max_dim"] = max(t.dim for t in tables)
    try:
        limits = ShardLimits(**given)
        for t in tables:
            limits.check_table(t)
    except ConfigError as exc:
        raise ConfigError(re.sub(r"\b(PS limit )?(max_[a-z_]+|aggregation_timeout_ms)\b", _option, str(exc))) from None
    if args.ready_file is not None:
        check_output_file(args.ready_file, "--ready-file")
    if args.checkpoint_root is not None:
        check_existing_folder(args.checkpoint_root, "--checkpoint-root")
    check_bind(args.bind, args.keys, args.insecure, f"ps shard {args.shard}")
    token = None
    if args.token_file is not None:
        read_text_file(args.token_file, "--token-file", max_bytes=4096)  # a clear error before load_token's checks
    token = load_token(args.token_file)
    return tables, limits, token


def _option(match: re.Match) -> str:
    """A limit's name in a ShardLimits error, as its ``herald serve ps`` option."""
    return "--" + match.group(2).replace("_", "-")


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
    p = serve.add_parser(
        "ps",
        help="run one embedding parameter-server shard",
        description="Serve one shard of the embedding parameter server. Every flag is checked before the "
        "socket is bound (NOTE [front doors], docs/operations.md). The socket refuses any frame larger than "
        "the smaller of --max-keys-per-request rows of the widest row --max-dim allows and --max-shard-bytes "
        "(NOTE [message size limits], docs/operations.md).",
    )
    p.add_argument(
        "--shard", type=int_type(0, MAX_SHARDS - 1), required=True, help="this shard's index in [0, num-shards)"
    )
    p.add_argument(
        "--num-shards", type=int_type(1, MAX_SHARDS), required=True, help=f"total number of shards, 1..{MAX_SHARDS}"
    )
    add_bind_argument(p, "tcp://127.0.0.1:*", note="loopback by default; '*' port = any free port; ")
    p.add_argument("--tables", default=None, metavar="FILE", help="JSON file: list of table declarations (docs/ps.md)")
    p.add_argument("--seed", type=int_type(0), default=0, help="initialiser seed, equal on every shard")
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
        help="checkpoint and restore only to folders inside DIR, an existing folder (default: both refused)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="file (mode 600) holding the admin token that checkpoint, restore and shutdown requests "
        "must carry (default: the HERALD_PS_TOKEN environment variable; none: shutdown refused)",
    )
    _add_limits(p)
    p.set_defaults(func=_serve)


def _add_limits(p) -> None:
    """One option per NOTE [ps limits] entry, each default stated in --help (None: the default
    of :class:`ShardLimits`, or the one derived from the tables file and the host)."""
    defaults = ShardLimits()
    for name, text in _LIMITS.items():
        default = getattr(defaults, name)
        if name == "max_dim":
            shown = f"the widest dim of --tables, else {default}"
        elif name == "max_shard_bytes":
            shown = f"3/4 of this host's memory, {host_shard_bytes()} bytes here"
        else:
            shown = str(default)
        high = MAX_TABLES if name == "max_tables" else 65535 if name == "max_contributors" else INT64_MAX
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int_type(0 if name == "max_rows" else 1, high),
            default=None,
            help=f"{text} (NOTE [ps limits]; default: {shown})",
        )
