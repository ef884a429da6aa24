"""``herald serve dispatcher``: the dispatcher of a job as its own process.

``herald serve dispatcher`` exit status: 0 done; 1 an error; 2 invalid options; 75 a
PS shard was lost (NOTE [ps failover across hosts] in herald/job/recovery/failover.py: restart
the shard, then this command with ``--resume``). ``--checkpoint-every`` / ``--resume``
need the PS admin token in ``HERALD_PS_TOKEN`` and a ``--run-dir`` that the PS shards
(their ``--checkpoint-root``) and worker rank 0 see at the same path.
"""

from __future__ import annotations

import argparse
import os

from herald.contracts.vocab import MAX_PS_SHARDS
from herald.errors import ConfigError
from herald.inputs import add_bind_argument, check_output_file, int_type, parse_endpoint
from herald.job.cli import add_job_arguments, check_job_inputs, config_from_args

# The functions below import the job's parts on use: this module is imported to build the
# herald parser, which must not load numba, torch or zmq (~3 s: herald/cli.py).


def _serve_dispatcher(args: argparse.Namespace) -> int:
    """``herald serve dispatcher``: the job runner (NOTE [job runner] in herald/job/runner.py)
    with remote PS shards, workers started elsewhere and no report; with ``--checkpoint-every``
    / ``--resume`` it checkpoints and resumes as ``herald train`` does, and a lost PS shard
    ends it with exit status 75 (NOTE [ps failover across hosts])."""
    from herald.auth import check_bind  # on use: see the comment on the imports
    from herald.job.interfaces import RunOptions
    from herald.job.parts import ExternalWorkers, RemotePS
    from herald.job.runner import JobRunner

    cfg = config_from_args(args)
    _check(cfg, args)  # NOTE [front doors] in herald/inputs.py: every flag before the data or a socket
    # NOTE [transport security]: refuse an open bind (or bad keys) before reading any data; the
    # workers get the keys folder's path in the job (for the PS), never the keys
    disp_cfg = dispatcher_config(cfg, args)
    check_bind(disp_cfg.bind, disp_cfg.keys_dir, disp_cfg.insecure, "dispatcher")
    ckpts = _checkpointing(cfg)
    result = JobRunner(
        ps=RemotePS(args.ps.split(","), run_dir=cfg.run_dir if ckpts else None),
        workers=ExternalWorkers(dist_init=args.dist_init),
        checkpoints=ckpts,
        options=RunOptions(
            dispatcher_settings={"bind": args.bind, "dispatcher_rank": args.dispatcher_rank},
            sample_id_log=args.sample_id_log,
        ),
    ).run(cfg)
    records = result.records
    rejected = {k: n for k, n in (records[-1].rejected if records else {}).items() if n}
    print(
        f"dispatcher {disp_cfg.dispatcher_rank}: {len(records)} steps acked by all {cfg.workers} workers"
        + (f"; dropped messages (docs/operations.md): {rejected}" if rejected else "")
    )
    return 0


def _check(cfg, args: argparse.Namespace) -> None:
    """``herald serve dispatcher``'s own flags and the job's paths (:func:`herald.job.cli.check_job_inputs`;
    ``--run-dir`` only when it checkpoints), before any data is read or socket bound.

    Raises:
        ConfigError: naming the flag, the value and the fix.
    """
    if not args.ps:
        raise ConfigError("herald serve dispatcher needs --ps ADDRESS[,ADDRESS...] (the PS shards' endpoints)")
    shards = args.ps.split(",")
    if len(shards) > MAX_PS_SHARDS:
        raise ConfigError(f"--ps names {len(shards)} shards, more than the {MAX_PS_SHARDS} a job may have")
    for address in shards:
        parse_endpoint(address.strip(), "--ps", bind=False)
    if args.dist_init is not None and not args.dist_init.startswith(("env://", "file://")):
        parse_endpoint(args.dist_init, "--dist-init", bind=False)
    if args.sample_id_log is not None:
        check_output_file(args.sample_id_log, "--sample-id-log", make_folder=True)
    check_job_inputs(cfg, run_dir=bool(cfg.checkpoint_every or cfg.resume))


def dispatcher_config(cfg, args: argparse.Namespace):
    """The :class:`~herald.dispatch.config.DispatcherConfig` of ``herald serve dispatcher``:
    the job's settings (``cfg``, a :class:`~herald.contracts.train.TrainConfig`) with this process's
    ``--bind`` and ``--dispatcher-rank`` (``args``): :func:`herald.job.runner.dispatcher_config`.

    Raises:
        ConfigError: a setting out of range (named by its flag).
    """
    from herald.job.runner import dispatcher_config as job_dispatcher_config  # on use: see the imports

    return job_dispatcher_config(cfg, bind=args.bind, dispatcher_rank=args.dispatcher_rank)


def _checkpointing(cfg):
    """The dispatcher's checkpoint part (``--checkpoint-every`` or ``--resume``), or None."""
    from herald.job.parts import Checkpointing  # on use: see the imports

    if not (cfg.checkpoint_every or cfg.resume):
        return None
    if not os.environ.get("HERALD_PS_TOKEN"):
        raise ConfigError(
            "herald serve dispatcher --checkpoint-every / --resume checkpoints and restores the PS "
            "through its admin ops: set HERALD_PS_TOKEN to the token the shards were started with "
            "(NOTE [ps admin ops], docs/operations.md)"
        )
    return Checkpointing("herald serve dispatcher", enabled=cfg.checkpoint_every > 0)


def register(commands, bench, serve) -> None:
    """Add ``serve dispatcher``."""
    d = serve.add_parser(
        "dispatcher",
        help="the dispatcher (scheduler + micro-batch dispatch) for N workers",
        description="Read a source, schedule global batches and serve micro-batches to N workers "
        "that connect with `herald serve worker`.",
    )
    # --run-dir, --checkpoint-every, --resume: NOTE [ps failover across hosts] (herald/job/recovery/failover.py);
    # --ps-restarts / --worker-restarts are the supervisor's (herald train), not this process's; --pin-cores pins
    # herald train's local processes (one role alone: taskset -c CORES herald serve ...); --launcher,
    # --ray-address, --storage-path choose who starts herald train's roles (this process starts none); --script is
    # what herald train's workers run (here: herald serve worker, or torchrun of a script that connects)
    add_job_arguments(
        d,
        exclude=(
            "log_sample_ids",
            "eval_every",
            "ps_restarts",
            "worker_restarts",
            "pin_cores",
            "launcher",
            "ray_address",
            "storage_path",
            "script",
            "script_args",
        ),
    )
    add_bind_argument(d, "tcp://127.0.0.1:5555")
    d.add_argument(
        "--dispatcher-rank",
        type=int_type(0, 255),
        default=0,
        help="this dispatcher's rank, 0-255: the top 8 bits of its sample ids (Persia §4.1), distinct per "
        "dispatcher when several feed one job's PS, e.g. each reading its own Kafka partitions "
        "(default: %(default)s)",
    )
    d.add_argument(
        "--sample-id-log",
        default=None,
        metavar="FILE",
        help="append the uint64 sample ids of every step acked by all workers to FILE",
    )
    d.add_argument("--ps", default="", help="comma-separated PS shard endpoints, in shard order")
    d.add_argument(
        "--dist-init",
        default=None,
        help="torch.distributed init method for the workers, e.g. tcp://127.0.0.1:29500 (default: workers use env://)",
    )
    d.set_defaults(func=_serve_dispatcher)
