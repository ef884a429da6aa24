"""Single-process reference training: the model BSP training must equal (Herald §3.3).

One process, every embedding row in a dict, the whole global batch at once: the
gradient of the mean loss over the global batch, the sparse optimizer applied once
per row per step with the PS's kernel, the dense optimizer stepped once. The
exactness test compares herald's distributed result against this.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from herald.contracts.job import JobSpec
from herald.contracts.models import reads_features
from herald.loader.batch import SampleBatch
from herald.ps import apply_gradients, init_rows
from herald.worker.pooling import batch_table_ids, features_from_rows, model_input
from herald.worker.trainer import build_dense_optimizer, model_from_job


def train_reference(job: JobSpec, batches: Iterable[SampleBatch]):
    """Train on ``batches`` (global batches) as one process.

    Args:
        job: the :class:`JobSpec` the dispatcher sends (tables, model, seed, dense optimizer, dense_dim).
        batches: global batches, in order.

    Returns:
        ``(model, rows)`` where ``rows[(table, id)]`` is the final float32 row
        (embedding + optimizer state) of every key touched.
    """
    tables = list(job.tables)
    seed = job.seed
    model = model_from_job(job)
    opt = build_dense_optimizer(model.parameters(), job.dense_optimizer, job.dense_lr)
    rows: dict[tuple[int, int], np.ndarray] = {}
    mean = np.array([f.pooling == "mean" for f in job.feature_list], bool)  # NOTE [tables and features]
    feature_tables = job.feature_tables  # features sharing a table share its rows (NOTE [tables and features])
    as_features = reads_features(job.model)
    for batch in batches:
        uniq, inv = batch_table_ids(batch.values, feature_tables, len(tables))
        for t, u in enumerate(uniq):
            new = [k for k in u.tolist() if (t, k) not in rows]
            if new:
                fresh = init_rows(tables[t], t, np.array(new, np.uint64), seed)
                rows.update({(t, k): r for k, r in zip(new, fresh)})
        leaves = [  # each table at its own width
            torch.from_numpy(
                np.stack([rows[(t, k)][: tables[t].dim] for k in u.tolist()])
                if u.size
                else np.zeros((0, tables[t].dim), np.float32)
            ).requires_grad_(True)
            for t, u in enumerate(uniq)
        ]
        if as_features:  # DIN: pooled features and padded sequences, as the workers' embedding(output="features")
            emb = features_from_rows(leaves, inv, batch.offsets, feature_tables, job.feature_list)
        else:
            pooled = [
                F.embedding_bag(
                    torch.from_numpy(inv[f]), leaves[t], torch.from_numpy(batch.offsets[f][:-1]), mode="sum"
                )
                for f, t in enumerate(feature_tables)
            ]
            emb = model_input(pooled, np.stack(batch.offsets), mean)
        logits = model(torch.from_numpy(batch.dense), emb)
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        for t, w in enumerate(leaves):
            if w.grad is None or not uniq[t].size:
                continue
            cur = np.stack([rows[(t, k)] for k in uniq[t].tolist()])
            apply_gradients(cur, np.ascontiguousarray(w.grad.numpy(), dtype=np.float32), tables[t])
            rows.update({(t, k): r for k, r in zip(uniq[t].tolist(), cur)})
    return model, rows
