"""What each model needs, stated once (herald/contracts/models.py) and read by the settings
check, the job spec and the models themselves."""

from __future__ import annotations

import types

import pytest

from herald.contracts.job import JobSpec
from herald.contracts.models import MODEL_NEEDS, check_model
from herald.contracts.train import TrainConfig
from herald.contracts.vocab import MODELS, SCALAR_SLICE_MODELS
from herald.errors import ConfigError
from herald.loader.batch import Schema


def test_every_model_has_one_entry():
    assert set(MODEL_NEEDS) == set(MODELS) - {"auto"}
    assert {m for m, n in MODEL_NEEDS.items() if n.min_dim == 2} == set(SCALAR_SLICE_MODELS)
    assert {m: n.tables for m, n in MODEL_NEEDS.items() if n.tables is not None} == {"ncf": 2}


@pytest.mark.parametrize(
    "model,tables,dim,message",
    [
        ("ncf", 26, 16, r"--model ncf \(NCF\) needs exactly 2 tables \(user, item\), and the source has 26"),
        ("ncf", 1, 16, "needs exactly 2 tables"),
        ("wdl", 26, 1, r"--model wdl needs --embedding-dim >= 2 \(the last element"),
        ("deepfm", None, 1, "--model deepfm needs --embedding-dim >= 2"),
        ("dlrm", 0, 16, "--model dlrm needs at least one embedding table"),
        ("auto", 0, 16, "--model auto needs at least one embedding table"),
    ],
)
def test_refusals_name_the_flags(model, tables, dim, message):
    with pytest.raises(ConfigError, match=message):
        check_model(model, tables, dim)


@pytest.mark.parametrize(
    "model,tables,dim",
    [("ncf", 2, 1), ("ncf", None, 1), ("dlrm", 26, 1), ("dcn", 3, 1), ("wdl", 26, 2), ("auto", 5, 1)],
)
def test_what_a_model_can_take_passes(model, tables, dim):
    check_model(model, tables, dim)


def test_a_resolved_model_is_named_with_what_was_asked():
    with pytest.raises(ConfigError, match=r"^--model auto \(here deepfm\) needs --embedding-dim >= 2"):
        check_model("deepfm", 22, 1, chosen_as="auto")


def test_check_schema_resolves_auto_and_shows_the_tables():
    schema = Schema(tuple(f"C{i}" for i in range(1, 27)), 13)
    TrainConfig.from_flags(model="auto", embedding_dim=1).check_schema(
        schema, None
    )  # synthetic / parquet: dlrm takes dim 1
    with pytest.raises(ConfigError, match=r"source has 26: C1, C2, C3, C4, \.\.\.; choose --model dlrm"):
        TrainConfig.from_flags(model="ncf").check_schema(schema, "criteo")
    with pytest.raises(ConfigError, match=r"--model auto \(here wdl\)"):
        TrainConfig.from_flags(embedding_dim=1).check_schema(schema, "criteo")


def test_the_job_spec_checks_the_same_needs():
    data = types.SimpleNamespace(dataset="parquet", schema=Schema(("a", "b", "c"), 0), replicated=[], replica_rows=0)
    with pytest.raises(ConfigError, match="--model ncf .* needs exactly 2 tables"):
        JobSpec.build(TrainConfig.from_flags(model="ncf"), data, ["tcp://127.0.0.1:1"])
    assert (
        JobSpec.build(TrainConfig.from_flags(model="dcn", embedding_dim=1), data, ["tcp://127.0.0.1:1"]).model == "dcn"
    )


# --- DIN (NOTE [din layout] in herald/contracts/train.py)
MOVIELENS_SIDE = Schema(("user", "item", "genres", "history"), 0)


def test_din_lays_out_movielens_side_features_itself():
    cfg = TrainConfig.from_flags(source="ratings.csv", model="din", embedding_dim=8)
    assert cfg.source_options_for("movielens") == {"side_features": True, "history_length": 20}
    tables, features = cfg.layout(MOVIELENS_SIDE)
    assert [t.name for t in tables] == ["user", "item", "genres"]
    assert [(f.name, f.table, f.pooling, f.max_length) for f in features] == [
        ("user", "user", "sum", 0),
        ("item", "item", "sum", 0),
        ("genres", "genres", "mean", 0),
        ("history", "item", "none", 20),
    ]
    cfg.check_schema(MOVIELENS_SIDE, "movielens")  # a sequence without --script: din reads it
    short = TrainConfig.from_flags(source="ratings.csv", model="din", source_options=(("history", 5),))
    assert short.source_options_for("movielens") == {"side_features": True, "history_length": 5}
    assert short.layout(MOVIELENS_SIDE)[1][3].max_length == 5
    # the other models keep one table per feature, and history=L is din's
    assert [t.name for t in TrainConfig.from_flags(model="dlrm").layout(MOVIELENS_SIDE)[0]] == list(
        MOVIELENS_SIDE.table_names
    )
    assert TrainConfig.from_flags(model="ncf").source_options_for("movielens") == {}


def test_din_refusals_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="history=L is the history length of --model din"):
        TrainConfig.from_flags(model="dlrm", source_options=(("history", 5),))
    with pytest.raises(ConfigError, match=r"history=L needs an int L in 1\.\."):
        TrainConfig.from_flags(model="din", source_options=(("history", 0),))
    cfg = TrainConfig.from_flags(source="x.tsv", model="din", source_options=(("history", 5),))
    with pytest.raises(ConfigError, match="declare your sequence feature's max_length with --tables"):
        cfg.source_options_for("criteo")
    criteo = Schema(tuple(f"C{i}" for i in range(1, 27)), 13)
    with pytest.raises(ConfigError, match=r"--model din \(DIN\) needs exactly one sequence feature.*--tables FILE"):
        TrainConfig.from_flags(source="x.tsv", model="din").check_schema(criteo, "criteo")
    # a --tables file wins over the layout, and declares din's features for any source
    decl = tmp_path / "t.toml"
    decl.write_text(
        '[tables.ads]\n[features.C1]\ntable = "ads"\n[features.C2]\ntable = "ads"\npooling = "none"\nmax_length = 4\n'
    )
    cfg = TrainConfig.from_flags(source="x.tsv", model="din", tables=str(decl))
    cfg.check_schema(criteo, "criteo")
    assert [(f.table, f.pooling) for f in cfg.layout(criteo)[1][:3]] == [("ads", "sum"), ("ads", "none"), ("C3", "sum")]
    mean_history = tmp_path / "m.toml"
    mean_history.write_text(
        '[tables.m]\n[features.item]\ntable = "m"\n[features.history]\ntable = "m"\npooling = "mean"\n'
    )
    with pytest.raises(ConfigError, match="exactly one sequence feature"):
        TrainConfig.from_flags(model="din", tables=str(mean_history)).check_schema(MOVIELENS_SIDE, "movielens")


def test_the_job_spec_checks_dins_features():
    data = types.SimpleNamespace(dataset="movielens", schema=MOVIELENS_SIDE, replicated=[], replica_rows=0)
    job = JobSpec.build(TrainConfig.from_flags(model="din"), data, ["tcp://127.0.0.1:1"])
    assert job.model == "din" and job.num_features == 4 and job.feature_tables == (0, 1, 2, 1)
    with pytest.raises(ConfigError, match="exactly one sequence feature"):
        job.replace(features=())
