"""What the benches share: the plain single-process PyTorch baseline, a ``herald train``
run measured as the benches measure it, and the figures compared from a job's report.

The plain baseline (used by :mod:`herald.bench.scale`, :mod:`herald.bench.gpu` and
:mod:`herald.bench.torchrec_baseline`): herald's DLRM over one ``nn.EmbeddingBag`` per
table, trained on the training split of a source read through herald's loader, ids
remapped per table with ``np.unique`` before the clock starts (what is trained and why:
:mod:`herald.bench.scale`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job.launcher import run_train
from herald.loader import splits
from herald.loader.global_batches import GlobalBatches
from herald.procs import cpu_seconds
from herald.worker.models import build_model

EVAL_FRACTION = 0.02
WARMUP_STEPS = 10
TOP_PHASES = 3


# ------------------------------------------------------------------ plain PyTorch


@dataclasses.dataclass
class PlainBatches:
    """The training split in memory, ids remapped per table to ``0 .. table_rows[t]-1``.

    ``batches``: ``(dense float32 [B, D], labels float32 [B], ids int64 [nnz_t] per table,
    offsets int64 [B] per table)``; ``read_s`` / ``remap_s``: seconds spent reading the
    rows through herald's loader and remapping the ids.
    """

    batches: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]
    table_rows: list[int]
    dense_dim: int
    read_s: float
    remap_s: float


def load_plain_batches(
    source: str, batch_size: int, *, eval_fraction: float = EVAL_FRACTION, max_steps: int | None = None
) -> PlainBatches:
    """Read the training split of ``source`` (the rows ``herald train`` trains on with
    ``eval_fraction``) as batches of ``batch_size`` (the partial last one dropped, as
    herald does) and remap each table's ids with ``np.unique``.

    Raises:
        ConfigError: fewer training rows than one batch.
    """
    t0 = time.perf_counter()
    train, ev, _ = splits.open_train_eval(source, eval_fraction, {})
    if ev is not None:
        ev.close()
    with GlobalBatches(train, batch_size, max_steps=max_steps) as batches:
        raw = list(batches)
    if not raw:
        raise ConfigError(f"{source}: no full batch of {batch_size} rows to train on; lower --batch-size")
    t1 = time.perf_counter()
    per_table, table_rows = [], []
    for t in range(raw[0].num_tables):
        uniq, inv = np.unique(np.concatenate([b.values[t] for b in raw]), return_inverse=True)
        cuts = np.cumsum([b.values[t].shape[0] for b in raw])[:-1]
        per_table.append(
            [torch.from_numpy(np.ascontiguousarray(part)) for part in np.split(inv.astype(np.int64), cuts)]
        )
        table_rows.append(max(1, int(uniq.shape[0])))
    out = [
        (
            torch.from_numpy(b.dense),
            torch.from_numpy(b.labels),
            [ids[i] for ids in per_table],
            [torch.from_numpy(np.ascontiguousarray(o[:-1])) for o in b.offsets],
        )
        for i, b in enumerate(raw)
    ]
    return PlainBatches(out, table_rows, raw[0].dense.shape[1], read_s=t1 - t0, remap_s=time.perf_counter() - t1)


class PlainDLRM(nn.Module):
    """herald's DLRM (dense part, seeded as herald seeds it) over ``nn.EmbeddingBag`` s
    (sum, sparse gradients, uniform(-0.05, 0.05) as herald's PS initialises rows).

    Forward: ``dense [B, D]``, ids and offsets per table -> logits ``[B]``.
    """

    def __init__(self, dense_dim: int, table_rows: list[int], embedding_dim: int, seed: int):
        super().__init__()
        self.dense = build_model("dlrm", dense_dim, len(table_rows), embedding_dim, seed=seed)
        scale = TableConfig(name="t", dim=embedding_dim).init_scale
        gen = torch.Generator().manual_seed(seed)
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, embedding_dim, mode="sum", sparse=True) for n in table_rows)
        with torch.no_grad():
            for bag in self.bags:
                bag.weight.uniform_(-scale, scale, generator=gen)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        emb = torch.stack([bag(i, o) for bag, i, o in zip(self.bags, ids, offsets)], dim=1)
        return self.dense(dense, emb)


def train_loop(model: PlainDLRM, data: PlainBatches, warmup_steps: int) -> tuple[list[float], float]:
    """Every step's loss, and the seconds of the steps after the first ``warmup_steps``."""
    defaults = TrainConfig()
    sparse_opt = torch.optim.Adagrad(
        model.bags.parameters(), lr=defaults.embedding.lr, eps=OptimizerConfig("adagrad").eps
    )
    dense_opt = torch.optim.Adam(model.dense.parameters(), lr=defaults.dense.lr)
    losses, t0 = [], time.perf_counter()
    for step, (dense, labels, ids, offsets) in enumerate(data.batches):
        if step == warmup_steps:
            t0 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def timed_result(data: PlainBatches, warmup_steps: int, losses: list[float], train_s: float) -> dict:
    """A timed training loop's result over ``data``: ``{"samples_per_s", "timed_steps",
    "train_s", "losses"}``, the rate over the steps after ``warmup_steps``."""
    rows = sum(int(b[1].shape[0]) for b in data.batches[warmup_steps:])
    return {
        "samples_per_s": rows / train_s,
        "timed_steps": len(data.batches) - warmup_steps,
        "train_s": train_s,
        "losses": losses,
    }


def train_plain_torch(
    data: PlainBatches, *, embedding_dim: int = 16, seed: int = 0, warmup_steps: int = WARMUP_STEPS
) -> dict:
    """Train a fresh :class:`PlainDLRM` once over ``data`` with 1 torch thread (restored
    after); the clock starts after ``warmup_steps`` steps.

    Returns:
        ``{"samples_per_s", "timed_steps", "train_s", "losses", "cpu_us_per_sample"}``
        (``losses``: every step's; ``cpu_us_per_sample``: this process's CPU time over the
        whole loop, warm-up included, per sample trained).

    Raises:
        ConfigError: no step left to time after the warm-up.
    """
    if len(data.batches) <= warmup_steps:
        raise ConfigError(
            f"{len(data.batches)} batches leave nothing to time after {warmup_steps} warm-up "
            "steps; raise --rows or lower --batch-size"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # the sparse gradients come from EmbeddingBag itself: no invariant checks (torch's
        # default, said explicitly, which also silences its warning)
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            model = PlainDLRM(data.dense_dim, data.table_rows, embedding_dim, seed)
            cpu0 = cpu_seconds()
            losses, train_s = train_loop(model, data, warmup_steps)
            cpu_s = cpu_seconds() - cpu0
    finally:
        torch.set_num_threads(threads)
    all_rows = sum(int(b[1].shape[0]) for b in data.batches)
    return dict(timed_result(data, warmup_steps, losses, train_s), cpu_us_per_sample=1e6 * cpu_s / max(1, all_rows))


def plain_torch_losses(source: str, steps: int, *, batch_size: int = 256, seed: int = 0) -> list[float]:
    """The plain-PyTorch baseline's loss at each of its first ``steps`` steps on ``source``
    (to check that the baseline really trains)."""
    data = load_plain_batches(source, batch_size, max_steps=steps)
    return train_plain_torch(data, seed=seed, warmup_steps=0)["losses"]


# ------------------------------------------------------------------ herald


def run_herald(
    source: str,
    workers: int,
    schedule: str,
    batch_size: int,
    run_dir: str,
    seed: int = 0,
    device: str = "cpu",
    pin_cores: bool = False,
) -> dict:
    """One ``herald train`` job on ``device`` (``--device``; ``--pin-cores`` when ``pin_cores``);
    ``{"samples_per_s", "phases_ms", "wall_ms_per_step", "steps", "cpu_us_per_sample", "step_barrier"}``
    (``phases_ms``: the worker's median ms per phase, ``{}`` when the report has no
    ``phases``; ``step_barrier``: each shard's stats of its step barrier, NOTE [step barrier
    timing] in herald/ps/stepped.py, ``[]`` without step messages; ``cpu_us_per_sample``: the CPU
    time of every process of the job, start-up and held-out evaluation included, per
    trained sample: :func:`herald.procs.cpu_seconds`; ``steady_cpu_us_per_sample``: the
    report's, from the first step to the end of serving, NOTE [steady cpu] in
    herald/job/runner.py)."""
    cfg = TrainConfig.from_flags(
        source=source,
        schedule=schedule,
        workers=workers,
        batch_size=batch_size,
        eval_fraction=EVAL_FRACTION,
        seed=seed,
        run_dir=run_dir,
        device=device,
        pin_cores=pin_cores,
    )
    cpu0 = cpu_seconds()
    with contextlib.redirect_stdout(io.StringIO()):  # the report text: the table says what matters here
        rep = run_train(cfg, progress=False)
    cpu_s = cpu_seconds() - cpu0
    phases = rep.get("phases") or {}
    barriers = [b["step_barrier"] for b in phases.get("ps_busy", []) if "step_barrier" in b]
    return {
        "samples_per_s": rep["samples_per_second"],
        "step_barrier": barriers,  # per shard (NOTE [step barrier timing] in herald/ps/stepped.py)
        "cpu_us_per_sample": 1e6 * cpu_s / max(1, rep["steps"] * cfg.global_batch),
        "steady_cpu_us_per_sample": rep.get("steady_cpu_us_per_sample", float("nan")),
        "phases_ms": dict(phases.get("worker_ms_per_step", {})),
        "wall_ms_per_step": phases.get("wall_ms_per_step", rep["train_seconds"] * 1e3 / max(1, rep["steps"])),
        "wall_samples_per_s": rep.get("wall_samples_per_second"),
        "startup_s": rep.get("startup_seconds"),
        "steps": rep["steps"],
    }


def median_phases(phases: list[dict]) -> dict[str, float]:
    """Per phase, the median over runs of its ms per step (a phase a run lacks counts 0)."""
    names = list(dict.fromkeys(k for p in phases for k in p))
    return {k: round(statistics.median(p.get(k, 0.0) for p in phases), 3) for k in names}


def top_phases(phases: dict[str, float]) -> str:
    """The :data:`TOP_PHASES` phases taking most of a step, as ``"name ms, ..."``."""
    top = sorted(phases.items(), key=lambda kv: -kv[1])[:TOP_PHASES]
    return ", ".join(f"{k} {v:.2f}" for k, v in top) if top else "(no breakdown in the report)"


# ------------------------------------------------------------------ a job's report


def summarize(rep: dict) -> dict:
    """The figures a benchmark compares, from a job's report dict (``herald train``'s):
    steady samples/s, worker<->PS bytes on the wire, all-reduce bytes, embeddings moved,
    training seconds and steps."""
    return {
        "samples_per_second": rep["samples_per_second"],
        "wire_bytes": rep["wire_bytes"]["pulled"] + rep["wire_bytes"]["pushed"],
        "allreduce_bytes": rep["wire_bytes"]["allreduced"],
        "embeddings_moved": rep["transmissions"]["total"],
        "train_seconds": rep["train_seconds"],
        "steps": rep["steps"],
    }
