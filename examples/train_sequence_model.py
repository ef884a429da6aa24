"""A sequence model of your own on herald: a two-tower recommender whose user tower runs a
GRU over the user's rating history, trained as every worker of a ``herald train`` job
(docs/job.md, "Your own script"; docs/models.md, "Tables and features"):

    herald train --script examples/train_sequence_model.py --tables examples/movielens_tables.toml \\
        --source ../shared/data/movielens/ml-latest-small/ratings.csv --source-option side_features=true \\
        --workers 2 --batch-size 128 --epochs 1

The table file declares what no zoo model reads: the ``history`` feature is a sequence (the
movies the user rated before this rating, oldest first) that reads the ``movies`` table the
rated ``item`` reads, so a movie's row is one row whichever feature looks it up; ``genres``
is a mean-pooled bag of a narrower table (8 wide beside 16, its own optimizer).
``loader.embedding(output="features")`` gives them as a mapping: ``emb["item"]`` float32
[b, 16], ``emb["genres"]`` [b, 8], ``emb["history"]`` a padded sequence (``values`` float32
[b, L, 16], ``lengths`` int64 [b]); ``loader.feature_dims`` are the widths. Gradients reach
the rows of every one.

The model: user tower = user embedding + the GRU's last state over the history (zeros for
an empty one); item tower = item embedding + the mean genre embedding projected to the
item's width; logit = their dot product plus an MLP over both towers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from herald.worker.api import ScheduledLoader


class HistoryTwoTower(nn.Module):
    """Args: dim: the width of the user, item and history rows; genre_dim: the genres' width;
    hidden: the MLP's width."""

    def __init__(self, dim: int, genre_dim: int, hidden: int = 32):
        super().__init__()
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.genres = nn.Linear(genre_dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def history_state(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """float32 [b, dim]: the GRU's state after each sample's last history row (zeros: none)."""
        seen = lengths > 0
        out = values.new_zeros((values.shape[0], values.shape[2]))
        if bool(seen.any()):
            packed = nn.utils.rnn.pack_padded_sequence(
                values[seen], lengths[seen].cpu(), batch_first=True, enforce_sorted=False
            )
            _, h = self.gru(packed)
            out = out.index_put((seen.nonzero().squeeze(1),), h[-1])
        return out

    def forward(self, emb) -> torch.Tensor:
        """``emb``: the loader's features (user, item, genres pooled; history a sequence) -> logits [b]."""
        history = emb["history"]
        user = emb["user"] + self.history_state(history.values, history.lengths)
        item = emb["item"] + self.genres(emb["genres"])
        return (user * item).sum(1) + self.mlp(torch.cat([user, item], dim=1)).squeeze(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=32, help="the MLP's width")
    parser.add_argument("--lr", type=float, default=0.005, help="Adam's learning rate of the dense part")
    args = parser.parse_args(argv)

    with ScheduledLoader.connect() as loader:  # the job's dispatcher, rank and keys from the environment
        needed = {"user", "item", "genres", "history"}
        if not needed <= set(loader.feature_names):
            raise SystemExit(
                f"this model reads the features {sorted(needed)}; the job has {list(loader.feature_names)}: "
                "train on MovieLens with --source-option side_features=true --tables examples/movielens_tables.toml"
            )
        torch.manual_seed(loader.job.seed)  # every rank builds the same dense replica
        dims = dict(zip(loader.feature_names, loader.feature_dims))  # each feature's width
        if len({dims["user"], dims["item"], dims["history"]}) != 1:
            raise SystemExit(f"user, item and history must be one width for the towers' dot product, got {dims}")
        model = HistoryTwoTower(dims["item"], dims["genres"], args.hidden).to(loader.device)
        embedding = loader.embedding(output="features")
        loader.attach(model, torch.optim.Adam(model.parameters(), lr=args.lr))
        for batch in loader:
            logits = model(embedding(batch))
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            loader.step(loss, logits)  # logits: the report's progressive AUC
            if loader.rank == 0 and batch.step % 50 == 0:
                print(f"step {batch.step}: loss {loss.item():.4f}", flush=True)
        print(f"rank {loader.rank}: trained {loader.steps} steps", flush=True)


if __name__ == "__main__":
    main()
