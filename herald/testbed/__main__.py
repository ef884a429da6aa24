"""``python -m herald.testbed``: try a multi-host deployment on one machine (docs/testbed.md).

- ``run [herald train options] [--procs-per-host P] [--rate R] [--delay MS]``: build a
  bed (a PS host, a dispatcher host, ``--workers / P`` worker hosts), train the job
  across it (NOTE [test bed job]), print the report, tear the bed down.
- ``up [--hosts ps dispatcher worker0 worker1] [--rate R] [--delay MS]``: build a bed,
  print its hosts and the commands that start each role, and keep it until Ctrl-C /
  SIGTERM.
- ``cleanup [--all]``: remove the namespaces of beds whose owner process is gone
  (``--all``: every bed, also live ones).

Exit status: 0 done; 1 an error (the message names the fix); 2 bad options.
"""

from __future__ import annotations

import argparse
import signal
import sys

from herald.errors import ConfigError, HeraldError
from herald.job.cli import add_job_arguments, config_from_args
from herald.testbed import TestBed, cleanup_stale
from herald.testbed.job import bed_hosts, run_job


def _bed_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rate",
        default="1gbit",
        help="each host link's rate per direction, a tc rate such as 1gbit or "
        "100mbit; 'none': unshaped (default: %(default)s)",
    )
    p.add_argument(
        "--delay",
        type=float,
        default=None,
        help="each host link's one-way delay per direction, ms; > 0 needs the netem qdisc (default: "
        "0.2 where the kernel has netem, else none, with a warning)",
    )


def _run(args: argparse.Namespace) -> int:
    import pathlib

    cfg = config_from_args(args)
    if args.procs_per_host < 1 or cfg.workers % args.procs_per_host:
        raise ConfigError(f"--workers {cfg.workers} must be a multiple of --procs-per-host {args.procs_per_host}")
    run_dir = pathlib.Path(cfg.run_dir).resolve()
    with TestBed(
        bed_hosts(cfg.workers // args.procs_per_host),
        rate=None if args.rate == "none" else args.rate,
        delay_ms=args.delay,
        log_dir=run_dir / "logs",
    ) as bed:
        print(bed.describe(), flush=True)
        rep = run_job(bed, cfg, procs_per_host=args.procs_per_host, timeout_s=args.timeout_s)
    print((run_dir / "report.txt").read_text(), end="")
    for f in rep["failovers"]:
        print(
            f"failover: {f['cause']}: rolled back to {f['rolled_back_to']} ({f['steps_rolled_back']} steps trained "
            f"twice), roles restarted in {f['restart_s']} s, training again {f['recovered_s']} s after the loss"
        )
    return 0


def _up(args: argparse.Namespace) -> int:
    with TestBed(args.hosts, rate=None if args.rate == "none" else args.rate, delay_ms=args.delay) as bed:
        print(bed.describe())
        print(
            "\nstart a role in a host with `ip netns exec <namespace> <command>` (docs/testbed.md has the "
            "commands of a whole job); Ctrl-C tears the bed down.",
            flush=True,
        )
        try:
            while True:  # until the user stops it: SIGINT here, SIGTERM / SIGHUP tear down (NOTE [test bed teardown])
                signal.pause()
        except KeyboardInterrupt:
            print("\ntearing the test bed down", file=sys.stderr)
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    removed = cleanup_stale(everything=args.all)
    print(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m herald.testbed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = commands.add_parser("run", help="train a job across a fresh bed, print the report, tear the bed down")
    # --checkpoint-every with --ps-restarts N: failover across the bed's hosts (NOTE [test bed failover])
    add_job_arguments(r, exclude=("resume", "log_sample_ids", "eval_every", "pin_cores"))
    r.add_argument("--procs-per-host", type=int, default=1, help="workers per worker host (default: %(default)s)")
    r.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the whole job (default: %(default)s)")
    _bed_options(r)
    r.set_defaults(func=_run)

    u = commands.add_parser("up", help="build a bed and keep it until Ctrl-C")
    u.add_argument("--hosts", nargs="+", default=["ps", "dispatcher", "worker0", "worker1"])
    _bed_options(u)
    u.set_defaults(func=_up)

    c = commands.add_parser("cleanup", help="remove the namespaces of beds whose owner is gone")
    c.add_argument("--all", action="store_true", help="also beds whose owner is alive")
    c.set_defaults(func=_cleanup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HeraldError as exc:
        print(f"herald.testbed: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
