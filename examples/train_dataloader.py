"""Train a plain PyTorch model with herald's loader as a DataLoader dataset (no scheduler,
no PS): one ``nn.EmbeddingBag`` per table + an MLP, on synthetic Criteo-shaped data by
default or on any herald source (docs/loader.md, "Using herald as a DataLoader").

    python examples/train_dataloader.py                        # synthetic, 32,768 rows
    python examples/train_dataloader.py --data ../shared/data/criteo/criteo_kaggle_sample_train.tsv

Ids are 64-bit hashes; each table hashes them into ``--rows-per-table`` embedding rows
(``id mod rows``). Under torchrun, give ``--rank``/``--world-size`` (or initialise
torch.distributed first): each rank then reads its own shard of the data.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from herald.loader.dataset import HeraldIterableDataset


class EmbeddingBagMLP(nn.Module):
    """Sum-pooled embedding per table, concatenated with the dense features, then an MLP.

    Args:
        num_tables: T; dense_dim: D; rows_per_table: embedding rows per table (ids are
            hashed into them); dim: embedding width; hidden: MLP width.
    """

    def __init__(self, num_tables: int, dense_dim: int, rows_per_table: int, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.rows = rows_per_table
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(rows_per_table, dim, mode="sum", include_last_offset=True) for _ in range(num_tables)
        )
        self.mlp = nn.Sequential(nn.Linear(dense_dim + num_tables * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, sparse: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """dense float32 [B, D]; sparse: per table (ids int64 [nnz], offsets int64 [B+1]) -> logits [B]."""
        pooled = [bag(torch.remainder(ids, self.rows), offsets) for bag, (ids, offsets) in zip(self.bags, sparse)]
        return self.mlp(torch.cat([dense, *pooled], dim=1)).squeeze(1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="path or URL of any herald source (default: synthetic Criteo)")
    p.add_argument("--rows", type=int, default=32768, help="rows of the synthetic default source")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument(
        "--rows-per-table",
        type=int,
        default=1000,
        help="embedding rows per table (ids are hashed into them; small: dense gradients)",
    )
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train; returns ``steps``, ``samples`` (seen by this rank), ``first_loss``, ``last_loss``
    (means over the first and last 10 steps) and ``samples_per_s``."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    data = args.data or f"synthetic://criteo?rows={args.rows}&seed={args.seed}"
    dataset = HeraldIterableDataset(
        data,
        args.batch_size,
        output="torch",
        shuffle_buffer=4 * args.batch_size,
        seed=args.seed,
        rank=args.rank,
        world_size=args.world_size,
    )
    tables = dataset.schema.table_names
    model = EmbeddingBagMLP(len(tables), dataset.schema.dense_dim, args.rows_per_table)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = DataLoader(dataset, batch_size=None, num_workers=args.num_workers)
    losses, samples, t0 = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)  # reseeds the shuffle, as DistributedSampler.set_epoch
        for batch in loader:
            logits = model(batch["dense"], [batch[name] for name in tables])
            loss = F.binary_cross_entropy_with_logits(logits, batch["labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            samples += batch["labels"].shape[0]
            if len(losses) % 20 == 0:
                print(f"epoch {epoch} step {len(losses)}: loss {loss.item():.4f}")
    seconds = time.perf_counter() - t0
    out = {
        "steps": len(losses),
        "samples": samples,
        "first_loss": sum(losses[:10]) / max(len(losses[:10]), 1),
        "last_loss": sum(losses[-10:]) / max(len(losses[-10:]), 1),
        "samples_per_s": samples / seconds,
    }
    print(
        f"{out['steps']} steps, {samples:,} samples in {seconds:.1f} s ({out['samples_per_s']:,.0f} samples/s); "
        f"loss {out['first_loss']:.4f} -> {out['last_loss']:.4f}"
    )
    return out


if __name__ == "__main__":
    main()
