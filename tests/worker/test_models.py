"""The models ``herald train`` builds: shapes, gradients, what each computes, a tiny
training run, and how ``--model auto`` resolves (Herald's workload table)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from herald import contracts
from herald.contracts.features import FeatureConfig
from herald.errors import ConfigError
from herald.worker.models import MODELS, DCNv2, DeepFM, WideAndDeep, build_model

B, DIM = 16, 5
# (model, dense_dim, num_tables): NCF takes exactly two tables
SHAPES = [
    ("dlrm", 3, 4),
    ("dlrm", 0, 4),
    ("wdl", 3, 4),
    ("wdl", 0, 4),
    ("deepfm", 3, 4),
    ("deepfm", 0, 4),
    ("dcn", 3, 4),
    ("dcn", 0, 4),
    ("ncf", 0, 2),
    ("ncf", 3, 2),
]
#: DIN's features on MovieLens (NOTE [din layout]): the history reads item's table
DIN_FEATURES = (
    FeatureConfig("user", "user"),
    FeatureConfig("item", "item"),
    FeatureConfig("genres", "genres", "mean"),
    FeatureConfig("history", "item", "none", 6),
)


def _inputs(dense_dim, num_tables, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(B, dense_dim, generator=gen)
    emb = (torch.rand(B, num_tables, DIM, generator=gen) - 0.5).requires_grad_(True)
    return dense, emb


@pytest.mark.parametrize("name,dense_dim,num_tables", SHAPES)
def test_forward_gives_one_logit_per_sample_and_every_parameter_gets_a_gradient(name, dense_dim, num_tables):
    model = build_model(name, dense_dim, num_tables, DIM, seed=1)
    dense, emb = _inputs(dense_dim, num_tables)
    logits = model(dense, emb)
    assert logits.shape == (B,) and logits.dtype == torch.float32
    F.binary_cross_entropy_with_logits(logits, torch.ones(B)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing, f"{name}: no gradient reaches {missing}"
    # every element of every pooled row is used, the scalar slice of wdl/deepfm included
    assert bool((emb.grad.abs().sum(dim=0) > 0).all()), f"{name}: some embedding elements get no gradient"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_seed_builds_equal_replicas_and_leaves_the_global_rng_alone(name):
    num_tables = 2 if name == "ncf" else 4
    features = DIN_FEATURES if name == "din" else None
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = (build_model(name, 3, num_tables, DIM, seed=7, features=features) for _ in range(2))
    assert torch.equal(before, torch.random.get_rng_state())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _silence_deep(model):
    last = model.deep[-1]
    torch.nn.init.zeros_(last.weight), torch.nn.init.zeros_(last.bias)


def test_wide_part_is_the_sum_of_the_scalar_slices_plus_a_linear_dense_term():
    model = WideAndDeep(3, 4, DIM)
    _silence_deep(model)
    dense, emb = _inputs(3, 4)
    want = emb[..., -1].sum(dim=1) + dense @ model.wide_dense.weight[0]
    torch.testing.assert_close(model(dense, emb), want, rtol=0, atol=1e-6)


def test_deepfm_is_first_order_plus_pairwise_field_interactions():
    model = DeepFM(2, 3, DIM)
    _silence_deep(model)
    with torch.no_grad():
        model.bias.fill_(0.25)
    dense, emb = _inputs(2, 3)
    fields = torch.cat([emb[..., :-1], dense.unsqueeze(2) * model.dense_vectors], dim=1)
    pairs = sum(
        (fields[:, i] * fields[:, j]).sum(dim=1) for i in range(fields.shape[1]) for j in range(i + 1, fields.shape[1])
    )
    first = 0.25 + emb[..., -1].sum(dim=1) + dense @ model.dense_weights.weight[0]
    torch.testing.assert_close(model(dense, emb), first + pairs, rtol=1e-5, atol=1e-5)


def test_dcn_cross_layer_is_x0_times_linear_of_xl_plus_xl():
    model = DCNv2(2, 3, DIM, cross_layers=1, deep_mlp=())
    dense, emb = _inputs(2, 3)
    x0 = torch.cat([dense, emb.flatten(1)], dim=1)
    lin = model.cross[0].linear
    x1 = x0 * (x0 @ lin.weight.T + lin.bias) + x0
    torch.testing.assert_close(model(dense, emb), model.deep(x1).squeeze(1), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,dense_dim,num_tables", [("dlrm", 2, 3), ("wdl", 2, 3), ("deepfm", 2, 3), ("dcn", 2, 3), ("ncf", 0, 2)]
)
def test_a_tiny_training_run_lowers_the_loss(name, dense_dim, num_tables):
    """Labels depend on table 0's id: the model must learn it through the embeddings."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (128, num_tables), generator=gen)
    labels = (ids[:, 0] % 2).float()
    dense = torch.rand(128, dense_dim, generator=gen)
    torch.manual_seed(0)
    tables = torch.nn.Parameter(torch.empty(num_tables, 20, DIM).uniform_(-0.05, 0.05))
    model = build_model(name, dense_dim, num_tables, DIM, seed=0)
    opt = torch.optim.Adam([tables, *model.parameters()], lr=0.01)
    losses = []
    for _ in range(100):
        emb = tables[torch.arange(num_tables), ids]  # [128, T, DIM] (one id per table)
        loss = F.binary_cross_entropy_with_logits(model(dense, emb), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"{name}: loss went {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_bad_shapes_and_names_raise_naming_the_fix():
    with pytest.raises(ConfigError, match="--embedding-dim >= 2"):
        build_model("wdl", 3, 4, 1, seed=0)
    with pytest.raises(ConfigError, match="--embedding-dim >= 2"):
        build_model("deepfm", 0, 4, 1, seed=0)
    with pytest.raises(ConfigError, match="exactly 2 tables"):
        build_model("ncf", 0, 3, DIM, seed=0)
    with pytest.raises(ConfigError, match="cross_layers >= 1"):
        DCNv2(2, 3, DIM, cross_layers=0)
    with pytest.raises(ConfigError, match="choose one of"):
        build_model("xdeepfm", 3, 4, DIM, seed=0)
    with pytest.raises(ConfigError, match="--model wdl needs --embedding-dim >= 2"):
        contracts.train.TrainConfig.from_flags(model="wdl", embedding_dim=1)


def test_the_job_options_name_every_model():
    assert set(contracts.vocab.MODELS) == set(MODELS) | {"auto"}
    assert set(contracts.train.WORKLOAD_MODELS.values()) <= set(MODELS)
    assert set(contracts.vocab.SCALAR_SLICE_MODELS) == {"wdl", "deepfm"}


@pytest.mark.parametrize(
    "dataset,num_tables,dense_dim,want",
    [
        ("criteo", 26, 13, "wdl"),
        ("movielens", 2, 0, "ncf"),
        ("avazu", 21, 0, "deepfm"),  # Herald W1-W3
        ("synthetic", 26, 13, "dlrm"),
        ("parquet", 2, 0, "ncf"),
        ("libfm", 10, 0, "dlrm"),
        (None, 3, 1, "dlrm"),
    ],
)
def test_auto_picks_the_herald_workload_model_of_a_known_dataset(dataset, num_tables, dense_dim, want):
    assert contracts.train.auto_model("auto", dataset, num_tables, dense_dim) == want
    assert contracts.train.auto_model("dcn", dataset, num_tables, dense_dim) == "dcn"


def test_the_job_spec_carries_the_resolved_model():
    from herald.loader.batch import Schema

    data = types.SimpleNamespace(
        dataset="avazu", schema=Schema(tuple(f"C{i}" for i in range(21)), 0), replicated=[], replica_rows=0
    )
    job = contracts.job.JobSpec.build(
        contracts.train.TrainConfig.from_flags(embedding_dim=4), data, ["tcp://127.0.0.1:1"]
    )
    assert job.model == "deepfm"
    with pytest.raises(ConfigError, match="--embedding-dim 2 or more"):
        contracts.job.JobSpec.build(
            contracts.train.TrainConfig.from_flags(embedding_dim=1), data, ["tcp://127.0.0.1:1"]
        )
