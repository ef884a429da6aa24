"""DIN benchmark: ``herald train --model din`` against a plain PyTorch DIN and herald's NCF.

In one run, for each seed of ``--seeds``, on a MovieLens ratings file (default
ml-latest-small; rows in time order, the last ``--eval-fraction`` held out, 1 epoch):

1. **herald din**: ``herald train --model din`` (:func:`herald.job.launcher.run_train`),
   ``--workers`` workers under bsp, ``--batch-size`` samples per worker, the history
   ``--source-option history=L`` (NOTE [din layout] in herald/contracts/train.py: side features on,
   history a sequence of the last L movies reading item's table, genres mean-pooled), sgd on the
   embeddings (``--lr``), adam on the dense parameters (``--dense-lr``);
2. **plain din**: what a user would write in one process with plain PyTorch: one
   ``nn.Embedding``-style weight per table (``user``, ``item``, ``genres``) holding exactly the ids
   of the data, initialised with herald's own initialiser (:func:`herald.ps.init_rows`, the rows
   the PS would create for those ids and that seed), ``F.embedding_bag`` (sum; mean for genres) and
   ``F.embedding`` over a padded ``[b, L]`` index (the last L of each history) with sparse
   gradients, herald's DIN module (:class:`herald.worker.din.DIN`, the same dense initialisation
   from the seed), ``torch.optim.SGD`` on the embeddings and ``torch.optim.Adam`` on the rest, the
   same split and the same global batches (``--workers x --batch-size`` rows, in order, the last
   partial one dropped as herald does); BSP equals one process (Herald §3.3), so the two AUCs
   differ only by float rounding and Adam's fused kernel (target: below 0.002);
3. **herald ncf**: ``herald train --model ncf`` on the same split (user and item only; the
   MovieLens workload model, Herald Table 1), the same optimizers and batches.

Printed: a table of held-out AUC per seed, the medians, and |AUC(herald din) - AUC(plain din)|;
``--out FILE.json`` keeps every figure. About 1.5 minutes on 2 cores for 3 seeds (measured: each
herald job 6-13 s with its start-up and evaluation, the plain script 2-3 s;
docs/results/2026-12-04-din.md). Run as ``herald bench din``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from herald.bench.table import print_head
from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train
from herald.job.report.metrics import log_loss, roc_auc
from herald.loader import GlobalBatcher, splits
from herald.ps import init_rows
from herald.worker.models import build_model
from herald.worker.pooling import PaddedSequence

#: |AUC(herald din) - AUC(plain din)| the run should stay under
TARGET_AUC_DIFF = 0.002
RUNS = ("herald_din", "plain_din", "herald_ncf")


def herald_config(args: argparse.Namespace, model: str, seed: int) -> TrainConfig:
    """The ``herald train`` settings of one run (``model`` din or ncf)."""
    return TrainConfig.from_flags(
        source=args.source,
        source_options=(("history", args.history),) if model == "din" else (),
        model=model,
        workers=args.workers,
        batch_size=args.batch_size,
        embedding_dim=args.embedding_dim,
        optimizer="sgd",
        lr=args.lr,
        dense_optimizer="adam",
        dense_lr=args.dense_lr,
        consistency="bsp",
        epochs=1,
        steps=args.steps,
        eval_fraction=args.eval_fraction,
        seed=seed,
        run_dir=str(pathlib.Path(args.run_dir) / f"{model}-seed{seed}"),
    )


def run_herald(cfg: TrainConfig) -> dict:
    """``{auc, logloss, eval_rows, steps, seconds}`` of one ``herald train`` job."""
    start = time.perf_counter()
    rep = run_train(cfg, progress=False)
    m = rep["metrics"]
    return {
        "auc": m.get("auc", float("nan")),
        "logloss": m.get("logloss", float("nan")),
        "eval_rows": m.get("eval_rows", 0),
        "steps": rep["steps"],
        "seconds": time.perf_counter() - start,
    }


class PlainDIN:
    """The plain single-process PyTorch DIN of the module docstring, for ``cfg`` (a ``--model din`` job).

    Args:
        cfg: herald's settings of the same run: its source, split, layout, dims, seed, batches, lrs.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        options = cfg.source_options_for("movielens")
        schema = splits.source_schema(cfg.source, options)
        tables, self.features = cfg.layout(schema)
        index = {t.name: i for i, t in enumerate(tables)}
        self.feature_tables = [index[f.table] for f in self.features]
        train, ev, self.split_info = splits.open_train_eval(cfg.source, cfg.eval_fraction, options)
        with GlobalBatcher(train, cfg.global_batch, drop_last=True) as batcher:
            self.batches = list(itertools.islice(batcher, cfg.steps))
        self.eval_batches = []
        if ev is not None:
            while (b := ev.read(4096)) is not None:
                self.eval_batches.append(b)
            ev.close()
        # each table holds exactly the ids of the data, as herald's initialiser makes them
        self.ids = []
        for t in range(len(tables)):
            seen = [b.values[f] for b in self.batches + self.eval_batches for f in self._reading(t)]
            self.ids.append(np.unique(np.concatenate(seen)) if seen else np.zeros(0, np.uint64))
        dim = tables[0].dim
        self.weights = [
            torch.from_numpy(np.ascontiguousarray(init_rows(table, t, self.ids[t], cfg.seed)[:, :dim])).requires_grad_()
            for t, table in enumerate(tables)
        ]
        self.model = build_model("din", 0, len(self.features), dim, seed=cfg.seed, features=tuple(self.features))

    def _reading(self, t: int) -> list[int]:
        return [f for f, ft in enumerate(self.feature_tables) if ft == t]

    def lookup(self, batch) -> dict:
        """Feature name -> pooled float32 [b, dim] or a padded [b, L, dim] sequence, with sparse gradients."""
        out: dict = {}
        for f, feature in enumerate(self.features):
            weight = self.weights[self.feature_tables[f]]
            idx = np.searchsorted(self.ids[self.feature_tables[f]], batch.values[f]).astype(np.int64)
            offsets = batch.offsets[f]
            if not feature.is_sequence:
                out[feature.name] = F.embedding_bag(
                    torch.from_numpy(idx), weight, torch.from_numpy(offsets[:-1]), mode=feature.pooling, sparse=True
                )
                continue
            length = feature.max_length
            keep = np.minimum(np.diff(offsets), length)  # the last `length` ids of each history
            at = (offsets[1:] - keep)[:, None] + np.arange(length)[None, :]
            mask = np.arange(length)[None, :] < keep[:, None]
            padded = np.where(mask, idx[np.where(mask, at, 0)] if idx.size else 0, 0)
            mask_t = torch.from_numpy(mask)
            values = F.embedding(torch.from_numpy(padded), weight, sparse=True) * mask_t[:, :, None]
            out[feature.name] = PaddedSequence(values, torch.from_numpy(keep.astype(np.int64)))
        return out

    def train(self) -> dict:
        """Train on the global batches, evaluate on the held-out rows: ``{auc, logloss, eval_rows, steps, seconds}``."""
        start = time.perf_counter()
        sparse = torch.optim.SGD(self.weights, lr=self.cfg.embedding.lr)
        dense = torch.optim.Adam(self.model.parameters(), lr=self.cfg.dense.lr)
        for batch in self.batches:
            logits = self.model(torch.from_numpy(batch.dense), self.lookup(batch))
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels))
            sparse.zero_grad()
            dense.zero_grad()
            loss.backward()
            sparse.step()
            dense.step()
        self.model.eval()
        labels, probs = [], []
        with torch.no_grad():
            for batch in self.eval_batches:
                probs.append(torch.sigmoid(self.model(torch.from_numpy(batch.dense), self.lookup(batch))).numpy())
                labels.append(batch.labels)
        y = np.concatenate(labels) if labels else np.zeros(0, np.float32)
        p = np.concatenate(probs) if probs else np.zeros(0, np.float32)
        return {
            "auc": roc_auc(y, p) if y.size else float("nan"),
            "logloss": log_loss(y, p) if y.size else float("nan"),
            "eval_rows": int(y.size),
            "steps": len(self.batches),
            "seconds": time.perf_counter() - start,
        }


def run(args: argparse.Namespace) -> dict:
    """Every seed's three runs; returns (and prints, and writes to ``--out``) the figures:
    ``{"runs": [{seed, herald_din, plain_din, herald_ncf, auc_diff}], "median": {...}, ...}``."""
    threads = torch.get_num_threads()
    runs = []
    for seed in args.seeds:
        row: dict = {"seed": seed}
        print(f"--- seed {seed}: herald --model din", flush=True)
        row["herald_din"] = run_herald(herald_config(args, "din", seed))
        print(f"--- seed {seed}: plain PyTorch DIN", flush=True)
        torch.set_num_threads(1)  # one process, one thread, as a user's script on a shared host
        try:
            row["plain_din"] = PlainDIN(herald_config(args, "din", seed)).train()
        finally:
            torch.set_num_threads(threads)
        print(f"--- seed {seed}: herald --model ncf", flush=True)
        row["herald_ncf"] = run_herald(herald_config(args, "ncf", seed))
        row["auc_diff"] = abs(row["herald_din"]["auc"] - row["plain_din"]["auc"])
        runs.append(row)
    median = {f"{name}_auc": statistics.median(r[name]["auc"] for r in runs) for name in RUNS}
    median["auc_diff"] = statistics.median(r["auc_diff"] for r in runs)
    result = {
        "source": args.source,
        "settings": {
            k: getattr(args, k)
            for k in ("workers", "batch_size", "history", "embedding_dim", "lr", "dense_lr", "eval_fraction", "steps")
        },
        "runs": runs,
        "median": median,
        "target_auc_diff": TARGET_AUC_DIFF,
        "within_target": max(r["auc_diff"] for r in runs) < TARGET_AUC_DIFF,
        "same_split": all(len({r[n]["eval_rows"] for n in RUNS}) == 1 for r in runs),
        "same_steps": all(r["herald_din"]["steps"] == r["plain_din"]["steps"] for r in runs),
    }
    print_table(result)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"written {args.out}")
    return result


def print_table(result: dict) -> None:
    """The markdown table of :func:`run`'s figures."""
    print_head(
        "seed | herald din AUC | plain din AUC | abs diff | herald ncf AUC | steps | eval rows | s (din, plain, ncf)"
    )
    for r in result["runs"]:
        d, p, n = (r[k] for k in RUNS)
        print(
            f"| {r['seed']} | {d['auc']:.4f} | {p['auc']:.4f} | {r['auc_diff']:.5f} | {n['auc']:.4f} | "
            f"{d['steps']} | {d['eval_rows']} | {d['seconds']:.0f}, {p['seconds']:.0f}, {n['seconds']:.0f} |"
        )
    m = result["median"]
    print(
        f"| median | {m['herald_din_auc']:.4f} | {m['plain_din_auc']:.4f} | {m['auc_diff']:.5f} | "
        f"{m['herald_ncf_auc']:.4f} | | | |"
    )
    verdict = "within" if result["within_target"] else "NOT within"
    print(f"\n|AUC(herald din) - AUC(plain din)| {verdict} the target {result['target_auc_diff']} on every seed")
