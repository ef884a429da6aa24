"""``herald`` subcommands of :mod:`herald.loader`; see :mod:`herald.cli`.

- ``herald datagen --out DIR_OR_FILE.parquet --rows N --seed S [--fit FILE | --preset NAME]``
- ``herald convert SRC DST.parquet [--format F] [--bad-records skip] [--quarantine FILE]
  [--source-option KEY=VALUE ...]``
- ``herald produce SOURCE --bootstrap HOST:PORT --topic T`` (:mod:`herald.loader.produce_cli`)
"""

from __future__ import annotations

import os

from herald.config import add_key_value_option, parse_value
from herald.errors import ConfigError
from herald.inputs import check_input_path, check_output_file, check_output_folder, int_type
from herald.loader.produce_cli import register as register_produce


def _datagen(args) -> int:
    # NOTE [front doors] in herald/inputs.py: the paths before pyarrow and numba load
    if args.fit is not None:
        check_input_path(args.fit, "--fit")
    if os.path.isdir(args.out) or not args.out.endswith(".parquet"):
        check_output_folder(args.out, "--out")
    else:
        check_output_file(args.out, "--out")
    from herald.loader.conversion import datagen  # on use: the herald parser must not load numba and pyarrow

    same = {name: getattr(args, name) for name in ("rows", "seed", "fit", "preset", "fit_rows", "row_group_rows")}
    out = datagen(args.out, progress=not args.quiet, force=args.force, **same)
    print(f"wrote {out['rows']:,} rows to {out['path']}")
    return 0


def _convert(args) -> int:
    if "://" not in args.src:
        check_input_path(args.src, "SRC")
    check_output_file(args.dst, "DST")
    if args.quarantine:
        check_output_file(args.quarantine, "--quarantine")
    from herald.loader.conversion import convert  # on use: as in _datagen

    options = {key: parse_value(value) for key, value in args.source_option}
    for key, flag in (("bad_records", "--bad-records"), ("quarantine_path", "--quarantine")):
        if key in options:
            raise ConfigError(f"--source-option {key}=... is the flag {flag} of herald convert; give {flag} instead")
    options["bad_records"] = args.bad_records
    if args.quarantine:
        options["quarantine_path"] = args.quarantine
    out = convert(
        args.src,
        args.dst,
        format=args.format,
        row_group_rows=args.row_group_rows,
        progress=not args.quiet,
        force=args.force,
        **options,
    )
    stats = out["source"]
    line = f"wrote {out['rows']:,} rows to {out['path']}; skipped: {stats.get('skipped') or 'none'}"
    if "side_skipped" in stats:  # NOTE [movielens side features]
        line += f"; side files skipped: {stats['side_skipped'] or 'none'}"
        line += f"; histories truncated: {stats['history_truncated']:,}"
    print(line)
    return 0


def register(commands, bench, serve) -> None:
    """Add this subpackage's parsers to the herald command groups."""
    p = commands.add_parser("datagen", help="write synthetic samples calibrated on real data to Parquet")
    p.add_argument("--out", required=True, help="output .parquet file or directory")
    p.add_argument("--rows", type=int_type(0), required=True, help="samples to write")
    p.add_argument("--seed", type=int_type(0), default=0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fit", help="real data file to fit cardinalities, skew, dense stats and CTR to")
    g.add_argument("--preset", help="built-in spec: criteo-kaggle (default)")
    p.add_argument("--fit-rows", type=int_type(1), default=1_000_000, help="rows of --fit to read")
    p.add_argument("--row-group-rows", type=int_type(1), default=131072)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=_datagen)

    p = commands.add_parser("convert", help="convert Criteo/Avazu/libFM/MovieLens/Parquet/synthetic to Parquet")
    p.add_argument("src", help="input path or synthetic:// URL")
    p.add_argument("dst", help="output .parquet file")
    p.add_argument("--format", default=None, help="input format (default: inferred from the name)")
    p.add_argument("--bad-records", choices=("strict", "skip"), default="strict")
    p.add_argument("--quarantine", default=None, help="file for raw bad records (with --bad-records skip)")
    add_key_value_option(
        p,
        "--source-option",
        "a setting of the input's format, repeatable (e.g. side_features=true history_length=50 for MovieLens)",
    )
    p.add_argument("--row-group-rows", type=int_type(1), default=131072)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file (never an input)")
    p.set_defaults(func=_convert)

    register_produce(commands)
