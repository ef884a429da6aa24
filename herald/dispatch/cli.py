"""``herald serve dispatcher``: the dispatcher of a job as its own process."""

from __future__ import annotations

import argparse

from herald.errors import ConfigError


def _serve_dispatcher(args: argparse.Namespace) -> int:
    from herald.dispatch.dispatcher import Dispatcher, DispatcherConfig
    from herald.job.cli import config_from_args
    from herald.job.data import JobData
    from herald.job.spec import JobSpec

    cfg = config_from_args(args)
    if not args.ps:
        raise ConfigError("herald serve dispatcher needs --ps ADDRESS[,ADDRESS...] (the PS shards' endpoints)")
    data = JobData(cfg)
    job = JobSpec.build(cfg, data, args.ps.split(",")).replace(run_dir=None, dist_init=args.dist_init)
    with Dispatcher(DispatcherConfig(num_workers=cfg.workers, bind=args.bind, peer_timeout_ms=cfg.timeout_ms),
                    data.batches, data.scheduler_factory(cfg), job) as disp:
        print(f"dispatcher listening on {disp.address}", flush=True)
        records = disp.serve()
    data.close()
    print(f"dispatcher: {len(records)} steps acked by all {cfg.workers} workers")
    return 0


def register(commands, bench, serve) -> None:
    """Add ``serve dispatcher``."""
    from herald.job.cli import add_job_arguments

    d = serve.add_parser("dispatcher", help="the dispatcher (scheduler + micro-batch dispatch) for N workers",
                         description="Read a source, schedule global batches and serve micro-batches to N workers "
                                     "that connect with `herald serve worker`.")
    add_job_arguments(d, exclude=("run_dir", "resume", "log_sample_ids", "checkpoint_every", "eval_every"))
    d.add_argument("--bind", default="tcp://127.0.0.1:5555", help="endpoint to bind (default: %(default)s)")
    d.add_argument("--ps", default="", help="comma-separated PS shard endpoints, in shard order")
    d.add_argument("--dist-init", default=None, help="torch.distributed init method for the workers, "
                                                     "e.g. tcp://127.0.0.1:29500 (default: workers use env://)")
    d.set_defaults(func=_serve_dispatcher)
