"""A TorchRec model on herald with tables declared as TorchRec declares them (docs/torchrec.md,
"Declared features"): ``EmbeddingBagConfig`` tables of different widths (one mean-pooled) and
an ``EmbeddingConfig`` sequence, taken as they are by ``Declarations.from_torchrec``; the
model reads herald's lookup as the ``KeyedTensor`` an ``EmbeddingBagCollection`` returns and
the ``JaggedTensor`` an ``EmbeddingCollection`` returns, and trains under ``herald train
--script`` with the PS and dispatcher as real processes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

if os.environ.get("CI", "").lower() != "true":  # CI installs torchrec (make torchrec): a missing one fails there
    pytest.importorskip("torchrec")
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402

from herald.contracts.features import Declarations  # noqa: E402

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import torch, torch.nn.functional as F
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor
from herald.worker.api import ScheduledLoader

class Over(torch.nn.Module):  # TorchRec's over-arch shape: pooled features concatenated, plus the sequence's mean
    def __init__(self, pooled_width, seq_width):
        super().__init__()
        width = pooled_width + seq_width
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    def forward(self, kt, jt):
        lengths = jt.lengths().clamp(min=1).unsqueeze(1).to(torch.float32)
        seq = torch.zeros(kt.values().shape[0], jt.values().shape[1]).index_add(
            0, torch.repeat_interleave(torch.arange(jt.lengths().shape[0]), jt.lengths()), jt.values()) / lengths
        return self.mlp(torch.cat([kt.values(), seq], dim=1)).squeeze(1)

with ScheduledLoader.connect() as loader:
    torch.manual_seed(0)
    widths = dict(zip(loader.feature_names, loader.feature_dims))
    pooled = [n for n in loader.feature_names if n != "history"]
    model = Over(sum(widths[n] for n in pooled), widths["history"])
    embedding = loader.embedding(output="features")
    loader.attach(model, torch.optim.Adam(model.parameters(), lr=0.01))
    for batch in loader:
        emb = embedding(batch)
        kt, jt = emb.to_keyed_tensor(), emb.to_jagged("history")
        assert isinstance(kt, KeyedTensor) and isinstance(jt, JaggedTensor)
        assert kt.keys() == pooled and kt.length_per_key() == [widths[n] for n in pooled], kt.length_per_key()
        logits = model(kt, jt)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        grads = batch.rows.rows.grad
        assert grads is not None and bool(grads.abs().sum() > 0)
        loader.step(loss, logits)
    print(f"rank {loader.rank}: trained {loader.steps} steps, widths {sorted(set(widths.values()))}", flush=True)
"""


def test_torchrec_configs_of_several_widths_and_a_sequence_train_on_herald(tmp_path, data_dir):
    configs = [
        EmbeddingBagConfig(num_embeddings=1000, embedding_dim=8, name="users", feature_names=["user"]),
        EmbeddingBagConfig(num_embeddings=10000, embedding_dim=16, name="movies", feature_names=["item"]),
        EmbeddingBagConfig(
            num_embeddings=20, embedding_dim=4, name="genres", feature_names=["genres"], pooling=PoolingType.MEAN
        ),
        EmbeddingConfig(num_embeddings=10000, embedding_dim=8, name="watched", feature_names=["history"]),
    ]
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps(Declarations.from_torchrec(configs, max_length=10).to_dict()))
    script = tmp_path / "torchrec_model.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ratings = data_dir / "movielens" / "ml-latest-small" / "ratings.csv"
    done = subprocess.run(
        [sys.executable, "-m", "herald", "train", "--source", str(ratings),
         "--source-option", "side_features=true", "--source-option", "history_length=10", "--tables", str(tables),
         "--workers", "2", "--batch-size", "64", "--steps", "10", "--run-dir", str(run_dir), "--quiet",
         "--script", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 10
    assert {t["name"]: t["dim"] for t in report["embeddings"]["tables"]} == {
        "users": 8,
        "movies": 16,
        "genres": 4,
        "watched": 8,
    }
    for rank in (0, 1):
        assert f"rank {rank}: trained 10 steps, widths [4, 8, 16]" in (run_dir / f"worker-{rank}.log").read_text()
