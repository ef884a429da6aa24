"""Train DLRM with herald's scheduled loader: the whole worker-side program.

Start the services (three shells, or add `&`):

    herald serve ps --shard 0 --num-shards 1 --bind tcp://127.0.0.1:6000 --tables tables.json
    herald serve dispatcher --source ../shared/data/criteo/criteo_kaggle_sample_train.tsv \
        --workers 2 --ps tcp://127.0.0.1:6000 --bind tcp://127.0.0.1:5555
    torchrun --nproc-per-node 2 examples/train_dlrm.py --dispatcher tcp://127.0.0.1:5555

(`herald train` does all of this in one command.) Under torchrun, RANK and
WORLD_SIZE come from the environment and torch.distributed rendezvous uses it too.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from herald.worker.api import ScheduledLoader
from herald.worker.models import DLRM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dispatcher", default="tcp://127.0.0.1:5555")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--lr", type=float, default=0.001)
    args = parser.parse_args()

    with ScheduledLoader.connect(args.dispatcher, rank=args.rank, world_size=args.world_size) as loader:
        job = loader.job  # tables, dense features, seed, ... from the dispatcher
        torch.manual_seed(job.seed)  # identical dense replicas on every rank
        model = DLRM(job.dense_dim, len(job.tables), loader.dim).to(loader.device)
        embedding = loader.embedding()  # batch -> [b, tables, dim], from the worker cache
        loader.attach(model, torch.optim.Adam(model.parameters(), lr=args.lr))
        for step, batch in enumerate(loader):  # evictions and pulls of the plan are done here
            logits = model(batch.dense, embedding(batch))
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            loader.step(loss)  # pushes per plan, dense all-reduce, ack
            if args.rank == 0 and step % 20 == 0:
                print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
