"""The GPU section of ``herald bench scale`` (run when CUDA is available).

On one GPU, at each batch size of ``--gpu-batch-sizes`` (default 256 and 4,096), on the
training split of the same source as the rest of the benchmark:

1. **plain PyTorch on the GPU**: the baseline of ``herald bench scale``
   (:mod:`herald.bench.common`: herald's DLRM over ``nn.EmbeddingBag(sparse=True)``,
   ``torch.optim.Adagrad`` on the embeddings, ``torch.optim.Adam`` on the rest), model
   and every batch moved to the GPU before the clock starts; the loop reads each step's
   loss (``loss.item()``), which waits for the GPU, so the time is the GPU's, not the
   launch queue's;
2. **herald, 1 worker on the GPU** (``--device cuda``, ``--cache-device auto``: the
   device-resident cache, NOTE [device cache] in herald/worker/device_cache.py);
3. **herald, 1 worker on the CPU** at the same batch size (``--device cpu``).

Samples/s of herald runs are the report's steady ``samples_per_second``, as in the rest
of the benchmark. The targets of a GPU run (docs/worker.md, "What overlaps with what
(CUDA)"): herald on the GPU >= 0.8x plain PyTorch on the GPU at batch 4,096, and faster
than herald on the CPU.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics

import torch

from herald.bench.common import (
    WARMUP_STEPS,
    PlainBatches,
    PlainDLRM,
    load_plain_batches,
    median_phases,
    run_herald,
    timed_result,
    top_phases,
    train_loop,
)
from herald.bench.table import print_head
from herald.errors import ConfigError


def train_plain_torch_on(
    data: PlainBatches, device: torch.device, *, embedding_dim: int = 16, seed: int = 0, warmup_steps: int | None = None
) -> dict:
    """:func:`herald.bench.common.train_plain_torch` with the model and every batch on ``device``.

    Args:
        data: a :class:`~herald.bench.common.PlainBatches` (CPU tensors; copied to ``device``
            before timing).

    Returns:
        ``{"samples_per_s", "timed_steps", "train_s", "losses"}``.

    Raises:
        ConfigError: no step left to time after the warm-up.
    """
    warmup = WARMUP_STEPS if warmup_steps is None else warmup_steps
    if len(data.batches) <= warmup:
        raise ConfigError(
            f"{len(data.batches)} batches leave nothing to time after {warmup} warm-up steps; "
            "raise --rows or lower --gpu-batch-sizes"
        )
    moved = [
        (d.to(device), y.to(device), [i.to(device) for i in ids], [o.to(device) for o in offs])
        for d, y, ids, offs in data.batches
    ]
    on_device = dataclasses.replace(data, batches=moved)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        model = PlainDLRM(data.dense_dim, data.table_rows, embedding_dim, seed).to(device)
        losses, train_s = train_loop(model, on_device, warmup)
    return timed_result(data, warmup, losses, train_s)


def gpu_section(source: str, args, tmp: str) -> list[dict]:
    """One row per batch size of ``args.gpu_batch_sizes``: plain PyTorch on the GPU, herald
    1 worker on the GPU and on the CPU (medians of ``args.repeats``); run dirs under ``tmp``."""
    device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for batch in args.gpu_batch_sizes:
        data = load_plain_batches(source, batch)
        plain = statistics.median(
            train_plain_torch_on(data, device, seed=args.seed)["samples_per_s"] for _ in range(args.repeats)
        )
        del data
        runs = {}
        for where in ("cuda", "cpu"):
            got = [
                run_herald(
                    source,
                    1,
                    "herald",
                    batch,
                    str(pathlib.Path(tmp) / f"gpu-{where}-b{batch}-r{r}"),
                    args.seed,
                    device=where,
                )
                for r in range(args.repeats)
            ]
            runs[where] = {
                "samples_per_s": statistics.median(g["samples_per_s"] for g in got),
                "phases_ms": median_phases([g["phases_ms"] for g in got]),
            }
        row = {
            "batch_size": batch,
            "plain_torch_gpu_samples_per_s": plain,
            "herald_gpu_samples_per_s": runs["cuda"]["samples_per_s"],
            "herald_cpu_samples_per_s": runs["cpu"]["samples_per_s"],
            "herald_gpu_vs_plain_gpu": runs["cuda"]["samples_per_s"] / plain,
            "herald_gpu_vs_herald_cpu": runs["cuda"]["samples_per_s"] / runs["cpu"]["samples_per_s"],
            "herald_gpu_phases_ms": runs["cuda"]["phases_ms"],
        }
        print(
            f"GPU, batch {batch}: plain PyTorch {plain:,.0f}, herald GPU {row['herald_gpu_samples_per_s']:,.0f}, "
            f"herald CPU {row['herald_cpu_samples_per_s']:,.0f} samples/s",
            flush=True,
        )
        out.append(row)
    return out


def print_gpu_table(rows: list[dict], device_name: str) -> None:
    """The GPU comparison as a Markdown table."""
    print(f"\nGPU ({device_name}), 1 herald worker, herald schedule\n")
    print_head(
        "batch | plain PyTorch GPU | herald GPU | vs plain GPU | herald CPU | GPU vs CPU "
        "| top herald GPU phases (ms/step)",
        lead="",
    )
    for r in rows:
        print(
            f"| {r['batch_size']} | {r['plain_torch_gpu_samples_per_s']:,.0f} | {r['herald_gpu_samples_per_s']:,.0f} "
            f"| {r['herald_gpu_vs_plain_gpu']:.2f}x | {r['herald_cpu_samples_per_s']:,.0f} "
            f"| {r['herald_gpu_vs_herald_cpu']:.2f}x | {top_phases(r['herald_gpu_phases_ms'])} |"
        )
