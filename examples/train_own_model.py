"""Your own model and training loop under ``herald train``: an FM + MLP, a model herald's zoo
does not have, trained by this script as every worker of the job (docs/job.md, "Your own
script"):

    herald train --script examples/train_own_model.py --workers 2 --steps 50 -- --hidden 64 --lr 0.01

``herald train`` starts the PS shards and the dispatcher, then runs this file as each worker
with the job in the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the dispatcher's
address and the keys), so ``ScheduledLoader.connect()`` takes no arguments. The progress bar,
the report (``RUN_DIR/report.txt``; no held-out evaluation: herald cannot rebuild this
model), ``--checkpoint-every`` / ``--resume`` and ``--worker-restarts`` / ``--ps-restarts``
are the job's as for herald's own loop; what this script prints goes to
``RUN_DIR/worker-R.log``.

The model reads what every herald job gives today: the dense features float32 ``[b, D]``
and one sum-pooled embedding per table, float32 ``[b, T, dim]`` (every table at
``--embedding-dim``). The FM part is Rendle's factorisation machine (ICDM'10, eq. 5: the
pairwise interactions of the tables' vectors in ``O(T dim)``); the MLP reads the dense
features beside the flattened embeddings; the logit is the sum of both.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from herald.worker.api import ScheduledLoader


class FMMLP(nn.Module):
    """Logit of an FM over the table embeddings plus an MLP over dense + embeddings.

    Args:
        dense_dim: D; num_tables: T; dim: the embedding width; hidden: the MLP's width.
    """

    def __init__(self, dense_dim: int, num_tables: int, dim: int, hidden: int = 64):
        super().__init__()
        self.linear = nn.Linear(dense_dim, 1) if dense_dim else None
        self.mlp = nn.Sequential(
            nn.Linear(dense_dim + num_tables * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """dense float32 [b, D], emb float32 [b, T, dim] -> logits float32 [b]."""
        fm = 0.5 * (emb.sum(1).pow(2) - emb.pow(2).sum(1)).sum(1)  # Rendle eq. 5
        deep = self.head(self.mlp(torch.cat([dense, emb.flatten(1)], dim=1))).squeeze(1)
        wide = self.linear(dense).squeeze(1) if self.linear is not None else 0.0
        return fm + deep + wide


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's width")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate of the dense part")
    parser.add_argument("--save", default=None, help="rank 0 saves the trained dense model here (torch.save)")
    args = parser.parse_args(argv)

    with ScheduledLoader.connect() as loader:  # the job's dispatcher, rank and keys from the environment
        job = loader.job
        torch.manual_seed(job.seed)  # every rank builds the same dense replica
        model = FMMLP(job.dense_dim, len(loader.feature_names), loader.dim, args.hidden).to(loader.device)
        embedding = loader.embedding()  # batch -> [b, T, dim], from the worker cache
        loader.attach(model, torch.optim.Adam(model.parameters(), lr=args.lr))
        for batch in loader:
            logits = model(batch.dense, embedding(batch))
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            loader.step(loss, logits)  # logits: the report's progressive AUC
            if loader.rank == 0 and batch.step % 20 == 0:
                print(f"step {batch.step}: loss {loss.item():.4f}", flush=True)
        if args.save and loader.dist_rank == 0:
            torch.save(model.state_dict(), args.save)
        print(f"rank {loader.rank}: trained {loader.steps} steps", flush=True)


if __name__ == "__main__":
    main()
