"""Train TorchRec's DLRM (``torchrec.models.dlrm.DLRM``) on herald's micro-batches.

herald's worker cache and parameter server hold the embedding tables; TorchRec's model
keeps its dense part (DenseArch, InteractionArch, OverArch). The change to a TorchRec
training script is two lines (docs/torchrec.md):

    model.sparse_arch.embedding_bag_collection = nn.Identity()   # herald does the lookup
    logits = model(batch.dense, embedding(batch))                 # embedding(output="keyed_tensor")

``embedding(batch)`` is the ``KeyedTensor`` an ``EmbeddingBagCollection`` would return
(keys = table names, sum-pooled [b, T x dim]); the gradient flows back through it into
herald's cache, and ``loader.step`` pushes it per the communication plan.

Run it alone (it starts one PS shard and a dispatcher, and trains as worker 0 of 1):

    python examples/train_torchrec_dlrm.py --steps 50

or, as examples/train_dlrm.py, against running services with any number of workers:

    torchrun --nproc-per-node 2 examples/train_torchrec_dlrm.py --dispatcher tcp://127.0.0.1:5555

Needs torchrec (``make torchrec``: docs/torchrec.md, "Install").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from herald.worker.api import ScheduledLoader

START_TIMEOUT_S = 120


def dlrm_for(loader: ScheduledLoader, dense_arch: list[int], over_arch: list[int]) -> nn.Module:
    """TorchRec's DLRM over the job's tables, its EmbeddingBagCollection replaced by
    herald's pooled embeddings (a KeyedTensor goes straight into its SparseArch)."""
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    job = loader.job
    if job.dense_dim == 0:
        raise SystemExit("DLRM needs dense features; this source has none (use a Criteo-shaped source)")
    # the tables' shapes only: on the meta device, no memory (the rows live in herald's PS)
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=loader.dim, num_embeddings=1, feature_names=[n])
        for n in loader.table_names
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(ebc, job.dense_dim, dense_arch + [loader.dim], over_arch + [1], dense_device=loader.device)
    model.sparse_arch.embedding_bag_collection = nn.Identity()
    return model


def train(loader: ScheduledLoader, lr: float, log_every: int) -> list[float]:
    """The training loop; returns the losses of this rank's steps."""
    torch.manual_seed(loader.job.seed)  # identical dense replicas on every rank
    model = dlrm_for(loader, dense_arch=[64], over_arch=[64])
    embedding = loader.embedding(output="keyed_tensor")  # batch -> torchrec.KeyedTensor
    loader.attach(model, torch.optim.Adam(model.parameters(), lr=lr))
    losses = []
    for step, batch in enumerate(loader):  # the plan's evictions and pulls are done
        logits = model(batch.dense, embedding(batch)).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        loader.step(loss, logits)  # pushes per plan, dense all-reduce, ack
        losses.append(loss.item())
        if loader.rank == 0 and step % log_every == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    return losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(path: pathlib.Path, proc: subprocess.Popen, what: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} was not ready within {START_TIMEOUT_S} s")
        time.sleep(0.05)
    return path.read_text().strip()


@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[str, subprocess.Popen]]:
    """One PS shard and a dispatcher for one worker, as child processes (stopped on exit)."""
    herald = [sys.executable, "-m", "herald", "serve"]
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="herald-torchrec-") as tmp:
        try:
            ready = pathlib.Path(tmp) / "ps.ready"
            procs.append(
                subprocess.Popen(
                    [
                        *herald,
                        "ps",
                        "--shard",
                        "0",
                        "--num-shards",
                        "1",
                        "--bind",
                        "tcp://127.0.0.1:*",
                        "--seed",
                        str(args.seed),
                        "--ready-file",
                        str(ready),
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
            ps = _wait_for(ready, procs[0], "the PS shard")
            address = f"tcp://127.0.0.1:{_free_port()}"
            procs.append(
                subprocess.Popen(
                    [
                        *herald,
                        "dispatcher",
                        "--source",
                        args.source,
                        "--workers",
                        "1",
                        "--batch-size",
                        str(args.batch_size),
                        "--steps",
                        str(args.steps),
                        "--embedding-dim",
                        str(args.embedding_dim),
                        "--lr",
                        str(args.lr),
                        "--seed",
                        str(args.seed),
                        "--ps",
                        ps,
                        "--bind",
                        address,
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            yield address, procs[1]
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=10)
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dispatcher", default=None, help="a running dispatcher (default: start PS + dispatcher)")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--source", default="synthetic://criteo?rows=200000&seed=0")
    parser.add_argument("--steps", type=int, default=200, help="global steps (started services only)")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch (started services only)")
    parser.add_argument("--embedding-dim", type=int, default=16, help="(started services only)")
    parser.add_argument("--lr", type=float, default=0.05, help="sparse (PS) learning rate (started services only)")
    parser.add_argument("--dense-lr", type=float, default=0.001, help="Adam learning rate of the dense part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()

    if args.dispatcher is not None:
        with ScheduledLoader.connect(args.dispatcher, rank=args.rank, world_size=args.world_size) as loader:
            losses = train(loader, args.dense_lr, args.log_every)
    else:
        with services(args) as (address, dispatcher):
            with ScheduledLoader.connect(address, rank=0, world_size=1) as loader:
                losses = train(loader, args.dense_lr, args.log_every)
            out, _ = dispatcher.communicate(timeout=60)
            if dispatcher.returncode != 0:
                raise SystemExit(f"the dispatcher failed (status {dispatcher.returncode}):\n{out[-2000:]}")
    if args.rank == 0 and losses:
        k = max(1, len(losses) // 5)
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"trained {len(losses)} steps: mean loss of the first {k} {first:.4f}, of the last {k} {last:.4f}")


if __name__ == "__main__":
    main()
