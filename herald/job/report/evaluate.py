"""The held-out evaluation of a trained job (:func:`evaluate`) and the rows a bounded PS
evicted (:func:`evictions`)."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from herald.errors import HeraldError
from herald.job.report.metrics import log_loss, roc_auc
from herald.ps import PSClient


def evaluate(job: dict[str, Any], source, run_dir: pathlib.Path, ps_addresses, batch_rows: int = 4096) -> dict:
    """Log loss and AUC of the trained model on ``source`` (the held-out split).

    Reads rank 0's dense parameters from ``run_dir`` and the embeddings from the PS
    (after the final flush the PS holds every latest row). Also checks that every
    rank ended with identical dense parameters.

    A bounded PS (``--ps-max-rows N``, NOTE [bounded ps]) refuses a request with more than
    N new keys of a table, so the client splits the pulls (as it splits every request:
    :meth:`PSClient.declare`) at ``min(max_keys_per_request, N)`` keys a request; the rows evicted
    while evaluating, and the evicted rows it reads again (re-initialised), are counted
    (:func:`evictions` of the shards' stats before and after).

    Returns:
        ``eval_rows`` (int), and with rows: ``auc``, ``logloss`` (float), ``dense_replicas_equal``
        (bool), ``ps_evicted_rows`` and ``ps_evicted_rows_read_again`` (int, during the evaluation).

    Raises:
        HeraldError: a rank's dense parameters are missing.
    """
    model, replicas_equal = _trained_model(job, run_dir)
    tables = list(job.tables)
    labels, probs = [], []
    with PSClient(list(ps_addresses), tables=tables, timeout_ms=job.timeout_ms, keys_dir=job.keys_dir) as client:
        before = client.stats()
        while (batch := source.read(batch_rows)) is not None:
            probs.append(_predict(model, client, batch, job))
            labels.append(batch.labels)
        first = evictions(before)
        during = {k: v - first[k] for k, v in evictions(client.stats()).items()}
    source.close()
    if not labels:
        return {"eval_rows": 0}
    y, p = np.concatenate(labels), np.concatenate(probs)
    return {
        "eval_rows": int(y.shape[0]),
        "auc": roc_auc(y, p),
        "logloss": log_loss(y, p),
        "dense_replicas_equal": bool(replicas_equal),
        **during,
    }


def _trained_model(job: Any, run_dir: pathlib.Path) -> tuple[Any, bool]:
    """``(model, replicas_equal)``: the job's model with rank 0's dense parameters from
    ``run_dir`` (in eval mode), and whether every rank's are identical.

    Raises:
        HeraldError: no rank's dense parameters in ``run_dir``.
    """
    # on use: torch (1.2 s to import) is not on the launcher's start-up path (its report line "start-up")
    import torch

    from herald.worker.trainer import model_from_job

    ranks = sorted(pathlib.Path(run_dir).glob("dense-rank*.pt"))
    if not ranks:
        raise HeraldError(f"no dense-rank*.pt in {run_dir}: the workers did not save their parameters")
    states = [torch.load(p, weights_only=True) for p in ranks]
    replicas_equal = all(all(torch.equal(s[k], states[0][k]) for k in states[0]) for s in states[1:])
    model = model_from_job(job)
    model.load_state_dict(states[0])
    model.eval()
    return model, replicas_equal


def _predict(model: Any, client: PSClient, batch: Any, job: Any) -> np.ndarray:
    """float32 [rows]: the model's probabilities for ``batch`` (a :class:`~herald.loader.batch.SampleBatch`),
    its embeddings (each table at its own width) pulled from the PS through ``client`` (features sharing
    a table, ``job.feature_tables``, share its rows) and pooled per feature as in training (summed, and
    divided by the bag's length for the mean-pooled features), or, for a model reading
    ``FeatureEmbeddings`` (DIN), built as the reference builds them (padded sequences too)."""
    import torch  # on use: see _trained_model
    import torch.nn.functional as F

    from herald.contracts.models import reads_features
    from herald.worker.pooling import batch_table_ids, features_from_rows, model_input

    feature_tables, dims = job.feature_tables, [t.dim for t in job.tables]
    uniq, inv = batch_table_ids(batch.values, feature_tables, len(dims))
    got = client.pull_async({t: u for t, u in enumerate(uniq) if u.size}).wait()
    rows = [  # each table at its own width
        torch.from_numpy(np.ascontiguousarray(got[t][:, : dims[t]]) if u.size else np.zeros((0, dims[t]), np.float32))
        for t, u in enumerate(uniq)
    ]
    with torch.no_grad():
        if reads_features(job.model):
            emb = features_from_rows(rows, inv, batch.offsets, feature_tables, job.feature_list)
        else:
            mean = np.array([f.pooling == "mean" for f in job.feature_list], bool)
            pooled = [
                F.embedding_bag(torch.from_numpy(inv[f]), rows[t], torch.from_numpy(batch.offsets[f][:-1]), mode="sum")
                for f, t in enumerate(feature_tables)
            ]
            emb = model_input(pooled, np.stack(batch.offsets), mean)
        logits = model(torch.from_numpy(batch.dense), emb)
    return torch.sigmoid(logits).numpy()


def evictions(ps_stats: list[dict] | None) -> dict[str, int]:
    """The rows a bounded PS evicted (NOTE [bounded ps]) over every shard and table of
    ``ps_stats`` (:meth:`PSClient.stats`; None: none): ``ps_evicted_rows``, and
    ``ps_evicted_rows_read_again``, the inserts of keys evicted earlier (re-initialised
    rows read again: NOTE [evictions read again] in herald/ps/evicted.py)."""
    tables = [t for st in ps_stats or () for t in st["tables"].values()]
    return {
        "ps_evicted_rows": sum(t.get("evicted_rows", 0) for t in tables),
        "ps_evicted_rows_read_again": sum(t.get("evicted_rows_read_again", 0) for t in tables),
    }
