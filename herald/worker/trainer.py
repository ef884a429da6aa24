"""The training loop a worker process runs (``herald serve worker``), built only on
the public API of :mod:`herald.worker.api`."""

from __future__ import annotations

import os
import pathlib

import torch
import torch.nn.functional as F

from herald.contracts.job import JobSpec
from herald.contracts.models import reads_features
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS
from herald.errors import ConfigError
from herald.files import PrivateFile
from herald.procs import startup_garbage_frozen
from herald.worker.api import ScheduledLoader
from herald.worker.models import build_model

DENSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


def build_dense_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    """Dense optimizer ``name`` (``sgd``, ``adagrad`` or ``adam``) with learning rate ``lr``.

    When every parameter is a float32 CPU tensor it is torch's fused CPU implementation
    (``fused=True``: one kernel per parameter instead of about ten small ops; Adam's step
    on herald's DLRM 1.04 -> 0.23 ms at one thread). The single-process reference
    (herald/job/reference.py) builds its optimizer here too, so both take the same steps.

    Args:
        params: iterable of the dense parameters.

    Raises:
        ConfigError: unknown optimizer name.
    """
    if name not in DENSE_OPTIMIZERS:
        raise ConfigError(f"unknown dense optimizer {name!r}; choose one of {sorted(DENSE_OPTIMIZERS)}")
    params = list(params)
    fused = bool(params) and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
    return DENSE_OPTIMIZERS[name](params, lr=lr, **({"fused": True} if fused else {}))


def model_from_job(job: JobSpec) -> torch.nn.Module:
    """The dense model described by a job (same parameters on every rank: seeded): one input
    per feature (``job.num_features``; features sharing a table are inputs each), each its width."""
    dims = job.feature_dims
    return build_model(
        job.model,
        job.dense_dim,
        job.num_features,
        max(dims),
        seed=job.seed,
        feature_dims=dims,
        features=job.feature_list,
    )


def worker_threads(world_size: int) -> int:
    """Intra-op threads for one of ``world_size`` worker processes on this host: the
    host's cores split evenly, at least 1.

    The workers share the host with each other (and with the dispatcher and PS), and
    torch's default (one thread per core, each) makes OpenMP threads spin against the
    other processes: on 2 cores and 2 workers, 1 thread each halves the CPU time of a
    run. ``OMP_NUM_THREADS`` in the environment wins over this.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, world_size))


def run_worker(
    dispatcher: str,
    rank: int,
    world_size: int,
    *,
    device: str | None = None,
    cache_device: str = "auto",
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    keys_dir: str | None = None,
) -> int:
    """Train until the dispatcher says end; rank files ``dense-rank<r>.pt`` in the job's run_dir.

    Returns:
        Number of steps trained.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(worker_threads(world_size))
    with ScheduledLoader.connect(
        dispatcher,
        rank=rank,
        world_size=world_size,
        device=device,
        cache_device=cache_device,
        timeout_ms=timeout_ms,
        keys_dir=keys_dir,
    ) as loader:
        with startup_garbage_frozen():  # NOTE [start-up garbage] in herald/procs.py
            job = loader.job
            model = model_from_job(job).to(loader.device)
            # DIN reads FeatureEmbeddings (its history as a padded sequence), the others the [b, T, dim] tensor
            embedding = loader.embedding(output="features" if reads_features(job.model) else "tensor")
            loader.attach(model, build_dense_optimizer(model.parameters(), job.dense_optimizer, job.dense_lr))
        timer = loader.timer
        for batch in loader:
            with timer("forward"):
                logits = model(batch.dense, embedding(batch))
                loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            with timer("backward"):
                loss.backward()
            loader.step(loss, logits)
        if job.run_dir:
            out = pathlib.Path(job.run_dir) / f"dense-rank{loader.dist_rank}.pt"
            with PrivateFile(out.with_suffix(".tmp"), "dense replica") as f:  # NOTE [private files]: 0600
                torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f)
            out.with_suffix(".tmp").replace(out)
        return loader.steps
