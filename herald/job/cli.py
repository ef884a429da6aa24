"""``herald train``; the job arguments shared with ``herald serve dispatcher``."""

from __future__ import annotations

import argparse

from herald.config import add_arguments, from_arguments
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.inputs import check_input_path, check_output_folder, host_port, wait_listening


def add_job_arguments(p: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
    """The options of :class:`herald.contracts.train.TrainConfig` (shared by ``herald train``
    and ``herald serve dispatcher``)."""
    add_arguments(p, TrainConfig, exclude=exclude)


def config_from_args(args: argparse.Namespace):
    """The :class:`~herald.contracts.train.TrainConfig` of parsed job options (``herald train``'s
    words after ``--`` appended to ``--script-arg``'s: :func:`add_script_arguments`)."""
    extra = tuple(getattr(args, "script_argv", None) or ())
    return from_arguments(TrainConfig, args, **({"script_args": (*args.script_args, *extra)} if extra else {}))


def check_job_inputs(cfg: TrainConfig, *, run_dir: bool = True) -> None:
    """The paths and addresses a job's settings name, checked on this host before anything
    starts (NOTE [front doors] in herald/inputs.py): a local ``--source`` is a file or a
    folder (never a FIFO, socket or device: reading one blocks), ``--run-dir`` a folder
    that can be made (with ``run_dir``), ``--keys`` a folder holding both key pairs, and a ``--ray-address
    HOST:PORT`` has a Ray head listening (within :data:`RAY_PROBE_S`).

    Raises:
        ConfigError: naming the flag, the value and the fix.
    """
    if "://" not in cfg.source:
        check_input_path(cfg.source, "--source")
    if cfg.script.path is not None:
        check_input_path(cfg.script.path, "--script", folder_ok=False)
    if run_dir:
        check_output_folder(cfg.run_dir, "--run-dir")
    if cfg.security.keys_dir is not None:  # the roles of a job need both pairs (NOTE [transport security])
        from herald.auth import load_client_keys, load_server_keys  # on use: herald/cli.py checks before zmq loads

        load_server_keys(cfg.security.keys_dir)
        load_client_keys(cfg.security.keys_dir)
    address = cfg.launcher.ray_address
    if cfg.launcher.is_ray and address is not None and address != "auto" and "://" not in address:
        host, port = host_port(address, "--ray-address")
        if not wait_listening(f"tcp://{host}:{port}", RAY_PROBE_S):
            raise ConfigError(
                f"--ray-address {address}: nothing listens there (tried for {RAY_PROBE_S:g} s): start the Ray "
                f"head (ray start --head --port {port}) or fix the address"
            )


#: How long ``herald train`` tries to reach a ``--ray-address HOST:PORT`` before saying nothing is there.
RAY_PROBE_S = 3.0


# --- herald train --script FILE [-- ARGS] (NOTE [own script] in herald/worker/script.py) ---
def add_script_arguments(p: argparse.ArgumentParser) -> None:
    """``herald train``'s words after ``--``: the arguments of ``--script``'s file."""
    p.add_argument(
        "script_argv",
        nargs="*",
        metavar="-- ARGS",
        help="after --: the arguments of --script's file (its sys.argv[1:])",
    )


# --- end of --script ---


def _train(args: argparse.Namespace) -> int:
    from herald.job.launcher import run_train  # on use: the parser must not load torch (~3 s: herald/cli.py)
    from herald.job.runner import process_started_at

    run_train(config_from_args(args), progress=not args.quiet, started_at=process_started_at())
    return 0


def register(commands, bench, serve) -> None:
    """Add ``train``."""
    p = commands.add_parser(
        "train",
        help="the main job: PS shard(s), a dispatcher and N workers as local processes (or Ray actors: --launcher ray)",
        description="Train a recommendation model with scheduled micro-batches: starts PS shard(s), the dispatcher "
        "and N worker processes, trains (exactly by default: --consistency bsp; bounded, hybrid and gba "
        "relax it), evaluates on the held-out split and writes a "
        "report (text, JSON, PNG). With no arguments it trains DLRM on a synthetic Criteo-shaped stream "
        "with 2 workers.",
    )
    add_job_arguments(p)
    add_script_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)
