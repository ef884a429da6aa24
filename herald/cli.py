"""The ``herald`` command line.

Each subpackage owns its subcommands in its own ``cli.py`` with a function
``register(commands, bench, serve)`` that adds parsers to the three
``argparse`` sub-command groups: top-level commands (``herald datagen``),
``herald bench ...`` and ``herald serve ...``. A parser sets ``func`` to a
callable taking the parsed namespace and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from herald import __version__
from herald.errors import ConfigError, HeraldError
from herald.job.cli import add_job_arguments, check_job_inputs, config_from_args

# Order decides the order in --help.
_COMMAND_MODULES = (
    "herald.loader.cli",
    "herald.ps.cli",
    "herald.job.serve_dispatcher",
    "herald.worker.cli",
    "herald.job.cli",
    "herald.bench.cli",
    "herald.auth",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (all subcommands registered)."""
    parser = argparse.ArgumentParser(
        prog="herald",
        description=(
            "herald: data loader and embedding scheduler for recommendation-model training. "
            "Reads samples (Parquet, Criteo TSV, Avazu CSV, libFM, MovieLens, Kafka, synthetic), "
            "allocates them to workers (Herald's LAIA), plans embedding synchronisation "
            "(Herald's communication plan) and serves embeddings from a CPU parameter server."
        ),
    )
    parser.add_argument("--version", action="version", version=f"herald {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = commands.add_parser(
        "bench", help="benchmarks that compare against a baseline measured in the same run"
    )
    bench = bench_parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    serve_parser = commands.add_parser("serve", help="run one role (PS shard, dispatcher, worker) as a process")
    serve = serve_parser.add_subparsers(dest="serve_command", metavar="ROLE")
    bench_parser.set_defaults(func=lambda args: _missing(bench_parser))
    serve_parser.set_defaults(func=lambda args: _missing(serve_parser))
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(commands, bench, serve)
    parser.set_defaults(func=lambda args: _missing(parser))
    return parser


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _check_train_options(argv: list[str]) -> int | None:
    """``herald train``'s options checked before the full parser is built (building it
    imports every subcommand's registration), so that a bad value is reported
    at once, before anything starts. Returns the exit status when they are invalid."""
    if argv[:1] != ["train"] or "-h" in argv or "--help" in argv:
        return None
    parser = argparse.ArgumentParser(prog="herald train", add_help=False)
    add_job_arguments(parser)
    args, _ = parser.parse_known_args(argv[1:])  # a malformed value exits 2 here, as the full parser would
    try:
        check_job_inputs(config_from_args(args))  # NOTE [front doors] in herald/inputs.py
    except ConfigError as exc:
        print(f"herald: error: {exc}", file=sys.stderr)
        return 2
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``herald`` console script.

    Exit status: 0 done; 1 an error (the message names the fix); 2 invalid command-line
    options (nothing was started); another code below 128 an error that carries its own
    (``exit_code``, e.g. 75: ``herald serve dispatcher`` lost a PS shard, NOTE [ps failover
    across hosts] in herald/job/recovery/failover.py); 128 + N a job stopped by signal N after a
    clean stop (130 SIGINT, 143 SIGTERM: report and final checkpoint written).

    Every error's line on stderr starts with ``herald: error:``; a clean stop on a signal
    is not an error and says ``herald: interrupted ...``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    early = _check_train_options(argv)
    if early is not None:
        return early
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HeraldError as exc:
        code = getattr(exc, "exit_code", None)
        if code is not None and int(code) >= 128:  # 128 + N: a job that stopped cleanly on a signal
            print(f"herald: {exc}", file=sys.stderr)
            return int(code)
        print(f"herald: error: {exc}", file=sys.stderr)
        return 1 if code is None else int(code)
    except KeyboardInterrupt:
        print("herald: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
