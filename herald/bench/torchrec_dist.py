"""TorchRec at N CPU workers: what a TorchRec user would run beside ``herald bench scale``.

For each N of the herald runs, N processes (``torch.multiprocessing``, spawned; a
``torch.distributed`` gloo group over a file store in a private temporary folder, gloo
listening on the loopback interface only) train the model of :mod:`herald.bench.torchrec_baseline`
(``torchrec.models.dlrm.DLRM``, herald's dense layer sizes and seed, 26 tables of embedding
dim 16, Adagrad on the embeddings with herald's lr and eps, Adam on the rest, mean BCE
loss, 1 torch thread per process) on the plain baseline's rows and batches
(:class:`herald.bench.common.PlainBatches`, ids remapped before the clock starts): rank r
trains on batches r, r + N, r + 2N, ..., so a step is N x batch samples, as a herald step
of N workers is.

- **DistributedModelParallel** first: ``DistributedModelParallel`` over a meta-device
  ``EmbeddingBagCollection`` with Adagrad fused into backward
  (``apply_optimizer_in_backward``), the sharding its planner chooses for CPU (TorchRec
  1.8 shards each table whole on one rank: ``table_wise``, FBGEMM's fused CPU kernel), the
  dense part under its DDP.
- where TorchRec cannot shard on this machine (the planner or the sharder raises), the
  entry names the failing call and its error (``dmp_error``) and the same
  ``EmbeddingBagCollection`` runs replicated under ``DistributedDataParallel`` instead
  (dense embedding gradients all-reduced, ``torch.optim.Adagrad``): ``mode`` says which ran.

The clock starts after ``warmup_steps`` steps on every rank (a barrier on each side);
``samples_per_s`` is every rank's timed samples over the slowest rank's timed seconds,
``cpu_us_per_sample`` every rank's process CPU time over its whole loop (warm-up in, as
the plain baseline's counts) per sample trained. TorchRec says it is not tuned for the
CPU: this is the peer, not a tuned ceiling.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from herald.auth import loopback_interface
from herald.bench.common import WARMUP_STEPS, PlainBatches, PlainDLRM
from herald.bench.torchrec_baseline import dlrm_with_dense_of, torchrec_import_error
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError

#: seconds one N-process run may take, start-up included, before it is stopped
RUN_TIMEOUT_S = 600.0
#: modes of a run: TorchRec's model parallelism, or the collection replicated under DDP
MODES = ("dmp", "ddp")


def _build(data: PlainBatches, seed: int, meta: bool):
    """``DLRM`` over an ``EmbeddingBagCollection`` (on the meta device when ``meta``: DMP
    materialises it per shard), herald's dense layers copied in, the tables initialised as
    herald's PS initialises rows (uniform in +-``init_scale``)."""
    # torchrec and FBGEMM are optional: imported only when a TorchRec run needs them
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    dim = 16
    scale = TableConfig(name="t", dim=dim).init_scale
    plain = PlainDLRM(data.dense_dim, data.table_rows, dim, seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=dim,
            num_embeddings=n,
            feature_names=[f"f{t}"],
            init_fn=lambda w, s=scale: torch.nn.init.uniform_(w, -s, s),
        )
        for t, n in enumerate(data.table_rows)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta" if meta else "cpu"))
    return dlrm_with_dense_of(plain, ebc, data.dense_dim, torch.device("cpu"))


def _sparse_kwargs() -> dict:
    return {"lr": TrainConfig().embedding.lr, "eps": OptimizerConfig("adagrad").eps}


class _ShardingFailed(RuntimeError):
    """TorchRec could not shard the model here; the message names the call."""


def _dmp(data: PlainBatches, seed: int):
    """``(model, dense optimizer, plan text)`` under ``DistributedModelParallel``.

    Raises:
        _ShardingFailed: naming the TorchRec call that raised.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = _build(data, seed, meta=True)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), _sparse_kwargs())
    try:
        dmp = DistributedModelParallel(module=model, device=torch.device("cpu"))
    except Exception as exc:  # the planner or a sharder: named in the entry, DDP runs instead
        raise _ShardingFailed(f"DistributedModelParallel(device=cpu): {type(exc).__name__}: {exc}") from exc
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    opt = torch.optim.Adam(dense, lr=TrainConfig().dense.lr)
    return dmp, opt, _plan_kinds(dmp)


def _plan_kinds(dmp) -> dict[str, str]:
    """``{table: "sharding type/compute kernel"}`` of the DMP's plan."""
    out = {}
    for plan in dmp.plan.plan.values():
        for name, ps in plan.items():
            out[name] = f"{ps.sharding_type}/{ps.compute_kernel}"
    return out


def _ddp(data: PlainBatches, seed: int):
    """``(model, optimizers)``: the collection replicated under ``DistributedDataParallel``."""
    model = _build(data, seed, meta=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sparse = list(model.sparse_arch.parameters())
    ids = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in ids]
    return ddp, [torch.optim.Adagrad(sparse, **_sparse_kwargs()), torch.optim.Adam(dense, lr=TrainConfig().dense.lr)]


def _rank_batches(data: PlainBatches, rank: int, world: int) -> list:
    """Rank ``rank``'s batches (``r, r + N, ...``, as many on every rank) as TorchRec input."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f{t}" for t in range(len(data.table_rows))]
    steps = len(data.batches) // world
    out = []
    for dense, labels, ids, offsets in data.batches[rank : steps * world : world]:
        lengths = [torch.diff(o, append=torch.tensor([i.shape[0]], dtype=o.dtype)) for i, o in zip(ids, offsets)]
        out.append((dense, labels, KeyedJaggedTensor(keys=keys, values=torch.cat(ids), lengths=torch.cat(lengths))))
    return out


def _rank_main(rank: int, world: int, store: str, data: PlainBatches, cfg: dict, out_dir: str) -> None:
    """One rank: join the group, build the model (DMP, else DDP), train, and (rank 0) write
    ``out_dir/result.json``."""
    if cfg["pin"] is not None:
        os.sched_setaffinity(0, {cfg["pin"][rank % len(cfg["pin"])]})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout_s"])
    )
    try:
        with warnings_off():
            entry = _train_rank(rank, world, data, cfg)
        if rank == 0:
            pathlib.Path(out_dir, "result.json").write_text(json.dumps(entry))
    finally:
        dist.destroy_process_group()


def _train_rank(rank: int, world: int, data: PlainBatches, cfg: dict) -> dict:
    batches = _rank_batches(data, rank, world)
    dmp_error, plan = None, None
    mode = cfg["mode"]
    if mode == "dmp":
        try:
            model, dense_opt, plan = _dmp(data, cfg["seed"])
            opts = [dense_opt]
        except _ShardingFailed as exc:
            dmp_error, mode = str(exc), "ddp"
    if mode == "ddp":
        model, opts = _ddp(data, cfg["seed"])
    warmup = cfg["warmup_steps"]
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for step, (dense, labels, kjt) in enumerate(batches):
        if step == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), labels)
        for o in opts:
            o.zero_grad()
        loss.backward()  # under DMP the embeddings' Adagrad runs inside backward
        for o in opts:
            o.step()
    dist.barrier()
    figures = torch.tensor(
        [time.perf_counter() - t0, time.process_time() - cpu0, float(loss.item())], dtype=torch.float64
    )
    slowest = figures[:1].clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    cpu = figures[1:2].clone()
    dist.all_reduce(cpu)
    timed = sum(int(b[1].shape[0]) for b in batches[warmup:]) * world
    trained = sum(int(b[1].shape[0]) for b in batches) * world
    return {
        "workers": world,
        "mode": mode,
        "samples_per_s": timed / max(float(slowest), 1e-9),
        "cpu_us_per_sample": 1e6 * float(cpu) / max(1, trained),
        "timed_steps": len(batches) - warmup,
        "global_batch": int(batches[0][1].shape[0]) * world,
        "sharding": plan,
        "dmp_error": dmp_error,
        "final_loss": float(figures[2]),
    }


@contextlib.contextmanager
def warnings_off():
    """TorchRec's warnings and log lines about its own defaults (the planner's storage
    reservation, DDP's ``broadcast_buffers``, fx tracing), once per rank: not ours to fix."""
    import logging
    import warnings

    for name in ("", "torchrec", "torch.fx._symbolic_trace"):  # "": TorchRec also logs to the root logger
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def torchrec_at(
    data: PlainBatches,
    workers: int,
    *,
    seed: int = 0,
    mode: str = "dmp",
    warmup_steps: int = WARMUP_STEPS,
    pin_cores: list[int] | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
) -> dict:
    """One TorchRec run at ``workers`` processes (see the module docstring).

    Args:
        data: the plain baseline's batches (CPU tensors; shared with the spawned ranks).
        mode: ``dmp`` (DistributedModelParallel, DDP where it cannot shard) or ``ddp``.
        pin_cores: rank r runs on core ``pin_cores[r % len]`` (None: unpinned).
        timeout_s: bound on the whole run; the ranks are stopped past it.

    Returns:
        ``{"workers", "mode", "samples_per_s", "cpu_us_per_sample", "timed_steps",
        "global_batch", "sharding" ({table: "type/kernel"} under DMP, else None),
        "dmp_error" (the failing call, or None), "final_loss"}``.

    Raises:
        ConfigError: torchrec missing, a bad mode, or too few batches for ``workers`` ranks
            after the warm-up; TimeoutError: the run outlasted ``timeout_s``;
            RuntimeError: a rank failed (its traceback in the message).
    """
    missing = torchrec_import_error()
    if missing:
        raise ConfigError(missing)
    if mode not in MODES:
        raise ConfigError(f"TorchRec mode must be one of {list(MODES)}, got {mode!r}")
    if len(data.batches) // workers <= warmup_steps:
        raise ConfigError(
            f"{len(data.batches)} batches give {workers} ranks nothing to time after {warmup_steps} warm-up "
            "steps each; raise --rows or lower --batch-size"
        )
    cfg = {"seed": seed, "mode": mode, "warmup_steps": warmup_steps, "pin": pin_cores, "timeout_s": timeout_s}
    env = {"OMP_NUM_THREADS": "1"}
    lo = loopback_interface()
    if "GLOO_SOCKET_IFNAME" not in os.environ and lo is not None:
        env["GLOO_SOCKET_IFNAME"] = lo  # the ranks share this host: gloo listens on loopback only
    with tempfile.TemporaryDirectory(prefix="herald-torchrec-") as tmp, _environ(env):
        store = f"file://{pathlib.Path(tmp) / 'store'}"
        ctx = mp.start_processes(
            _rank_main, args=(workers, store, data, cfg, tmp), nprocs=workers, join=False, start_method="spawn"
        )
        _join(ctx, workers, timeout_s)
        return json.loads(pathlib.Path(tmp, "result.json").read_text())


def _join(ctx, workers: int, timeout_s: float) -> None:
    """Wait for every rank, at most ``timeout_s``; a failed rank's error re-raised."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TorchRec at {workers} workers did not finish within {timeout_s:.0f} s")
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"TorchRec at {workers} workers: a rank failed: {str(exc).strip()[-800:]}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"TorchRec at {workers} workers: a rank exited: {exc}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """``env`` set in this process (the spawned ranks inherit it) and restored after."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def torchrec_runs(data: PlainBatches, counts: list[int], **kw) -> list[dict]:
    """:func:`torchrec_at` for each N of ``counts``; a run that fails records its error
    (``{"workers": N, "error": ...}``) and the next one goes on. ``[{"error": ...}]`` without torchrec."""
    missing = torchrec_import_error()
    if missing:
        return [{"error": missing}]
    out = []
    for n in counts:
        try:
            got = torchrec_at(data, n, **kw)
            print(
                f"TorchRec at {n} workers ({got['mode']}): {got['samples_per_s']:,.0f} samples/s, "
                f"{got['cpu_us_per_sample']:.1f} CPU us/sample",
                flush=True,
            )
        except (ConfigError, TimeoutError, RuntimeError) as exc:
            got = {"workers": n, "error": f"{type(exc).__name__}: {exc}"}
            print(f"TorchRec at {n} workers: {got['error']}", flush=True)
        out.append(got)
    return out
