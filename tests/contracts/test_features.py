"""Tables and features declared apart (NOTE [tables and features] in herald/contracts/features.py)."""

from __future__ import annotations

import json

import pytest

from herald.contracts.features import Declarations, FeatureConfig, TableDeclaration
from herald.contracts.job import JobSpec
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.loader.batch import Schema

ISSUE_FILE = """
[tables.ads]            # width, optimizer, lr and initialiser are optional
dim = 32
[tables.small]
dim = 4
optimizer = "sgd"
lr = 0.5
init = "normal"
init_scale = 0.01
[features.C1]
table = "ads"
[features.C2]
table = "ads"
pooling = "mean"
[features.C3]
table = "small"
[features.history]
table = "ads"
pooling = "none"
max_length = 20
"""


def _write(tmp_path, text, name="tables.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_file_of_the_docs_resolves_against_a_source(tmp_path):
    decl = Declarations.from_file(_write(tmp_path, ISSUE_FILE))
    tables, features = decl.resolve(("C1", "C2", "C3", "C4", "history"), 16, "adagrad", 0.05)
    # tables in order of first use along the source's features; C4 keeps its own at the flags' settings
    assert [t.name for t in tables] == ["ads", "small", "C4"]
    assert [t.dim for t in tables] == [32, 4, 16]
    assert tables[0].optimizer.name == "adagrad" and tables[0].optimizer.lr == 0.05
    small = tables[1]
    assert (small.optimizer.name, small.optimizer.lr, small.init, small.init_scale) == ("sgd", 0.5, "normal", 0.01)
    assert [(f.name, f.table, f.pooling, f.max_length) for f in features] == [
        ("C1", "ads", "sum", 0),
        ("C2", "ads", "mean", 0),
        ("C3", "small", "sum", 0),
        ("C4", "C4", "sum", 0),
        ("history", "ads", "none", 20),
    ]


def test_json_with_the_same_keys_gives_the_same_declarations(tmp_path):
    toml = Declarations.from_file(_write(tmp_path, ISSUE_FILE))
    as_json = Declarations.from_file(_write(tmp_path, json.dumps(toml.to_dict()), "tables.json"))
    assert as_json == toml


@pytest.mark.parametrize(
    "text,words",
    [
        ("[features.C1]\ntable = 'nope'\n", "not declared"),
        ("[tables.t]\ndim = 4\n[features.C9]\ntable = 't'\n", "not in the source"),
        ("[tables.t]\ndim = 4\n[tables.u]\n[features.C1]\ntable = 't'\n", "read by no feature"),
        ("[tables.C2]\n[features.C1]\ntable = 'C2'\n", "a declared table has that name"),
        ("[tables.t]\n[features.C1]\ntable = 't'\npooling = 'none'\n", "needs max_length"),
        ("[tables.t]\n[features.C1]\ntable = 't'\nmax_length = 3\n", "for sequences"),
        ("[tables.t]\n[features.C1]\ntable = 't'\npooling = 'max'\n", "unknown"),
        ("[tables.t]\ndim = true\n[features.C1]\ntable = 't'\n", "dim must be an int"),
        ("[tables.t]\ndim = 0\n[features.C1]\ntable = 't'\n", "dim must be an int"),
        ("[tables.t]\nlr = -1.0\n[features.C1]\ntable = 't'\n", "lr must be a finite number"),
        ("[tables.t]\noptimizer = 'lion'\n[features.C1]\ntable = 't'\n", "optimizer 'lion' is unknown"),
        ("[tables.t]\nwidth = 4\n[features.C1]\ntable = 't'\n", "unknown setting"),
        ("[tables.t]\n[features.C1]\npooling = 'sum'\n", r"missing \['table'\]"),
        ("[models.x]\n", "unknown section"),
        ("tables = 3\n", "must be a mapping"),
        ("[tables.t\n", "not valid TOML"),
    ],
)
def test_bad_declarations_are_refused_with_the_fix(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words) as err:
        Declarations.from_file(_write(tmp_path, text)).resolve(("C1", "C2"), 8, "sgd", 0.1)
    assert "Traceback" not in str(err.value)


def test_a_binary_or_deep_file_is_refused(tmp_path):
    path = tmp_path / "bin.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8"):
        Declarations.from_file(str(path))
    with pytest.raises(ConfigError, match="nests too deeply|not valid JSON"):
        Declarations.from_file(_write(tmp_path, "[" * 100_000, "deep.json"))


def test_torchrec_configs_as_they_are():
    torchrec = pytest.importorskip("torchrec")
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

    configs = [
        EmbeddingBagConfig(num_embeddings=100, embedding_dim=8, name="ads", feature_names=["C1", "C2"]),
        EmbeddingBagConfig(
            num_embeddings=10, embedding_dim=8, name="small", feature_names=["C3"], pooling=PoolingType.MEAN
        ),
        EmbeddingConfig(num_embeddings=100, embedding_dim=8, name="items", feature_names=["history"]),
    ]
    decl = Declarations.from_torchrec(configs, max_length=5)
    assert torchrec is not None
    assert {t.name: t.dim for t in decl.tables} == {"ads": 8, "small": 8, "items": 8}
    assert {f.name: (f.table, f.pooling, f.max_length) for f in decl.features} == {
        "C1": ("ads", "sum", 0),
        "C2": ("ads", "sum", 0),
        "C3": ("small", "mean", 0),
        "history": ("items", "none", 5),
    }
    with pytest.raises(ConfigError, match="max_length"):
        Declarations.from_torchrec(configs)  # a sequence needs its bound


def test_without_a_file_every_feature_keeps_its_own_table():
    cfg = TrainConfig.from_flags(source="x.tsv", embedding_dim=8)
    tables, features = cfg.layout(Schema(("a", "b"), 0))
    assert [t.name for t in tables] == ["a", "b"] and all(t.dim == 8 for t in tables)
    assert features == [FeatureConfig("a", "a"), FeatureConfig("b", "b")]


def test_train_flag_names_the_file_and_checks_it_first(tmp_path):
    with pytest.raises(ConfigError, match="--tables"):
        TrainConfig.from_flags(source="x.tsv", tables=str(tmp_path / "missing.toml"))
    bad = _write(tmp_path, "[tables.t]\ndim = -3\n[features.a]\ntable = 't'\n")
    with pytest.raises(ConfigError, match="dim must be an int"):
        TrainConfig.from_flags(source="x.tsv", tables=bad)


def test_the_job_refuses_what_the_models_cannot_train(tmp_path):
    schema = Schema(("a", "b", "s"), 2)
    mixed = _write(tmp_path, "[tables.t]\ndim = 4\n[features.a]\ntable = 't'\n", "mixed.toml")
    with pytest.raises(ConfigError, match="--model dlrm .DLRM. needs every table at one width.*--model dcn"):
        TrainConfig.from_flags(source="x.tsv", tables=mixed, embedding_dim=8, model="dlrm").check_schema(schema, None)
    TrainConfig.from_flags(source="x.tsv", tables=mixed, embedding_dim=8, model="dcn").check_schema(schema, None)
    with pytest.raises(ConfigError, match="bsp and bounded, not hybrid"):
        TrainConfig.from_flags(
            source="x.tsv", tables=mixed, embedding_dim=8, model="dcn", consistency="hybrid"
        ).check_schema(schema, None)
    seq = _write(tmp_path, "[tables.t]\n[features.s]\ntable = 't'\npooling = 'none'\nmax_length = 4\n", "seq.toml")
    with pytest.raises(ConfigError, match="--script"):
        TrainConfig.from_flags(source="x.tsv", tables=seq).check_schema(schema, None)


def test_job_spec_carries_the_features():
    tables = (TableDeclaration("t", dim=4).table(4, "sgd", 0.1), TableDeclaration("u", dim=4).table(4, "sgd", 0.1))
    features = (FeatureConfig("a", "t", "mean"), FeatureConfig("b", "u", "none", 3))
    job = JobSpec(tables=tables, dense_dim=1, ps=("ipc:///x",), features=features)
    back = JobSpec.from_dict(job.to_dict())
    assert back.features == features and back.feature_tables == (0, 1) and back.num_features == 2
    assert JobSpec(tables=tables, dense_dim=1, ps=("ipc:///x",)).feature_list == (
        FeatureConfig("t", "t"),
        FeatureConfig("u", "u"),
    )
    with pytest.raises(ConfigError, match="hybrid"):
        from herald.contracts.modes import mode_from_dict

        JobSpec(
            tables=tables, dense_dim=1, ps=("ipc:///x",), features=features, mode=mode_from_dict({"name": "hybrid"})
        )


def test_one_dim_with_optimizers_of_other_state_widths_suits_every_model(tmp_path):
    """Row widths differ (adagrad's state beside rowwise_adagrad's), dims do not: the pairwise
    models train it; hybrid and gba, whose workers hold one row width, refuse it."""
    schema = Schema(("a", "b"), 2)
    text = "[tables.t]\ndim = 8\noptimizer = 'adagrad'\n[features.a]\ntable = 't'\n"
    path = _write(tmp_path, text, "opt.toml")
    cfg = TrainConfig.from_flags(
        source="x.tsv", tables=path, embedding_dim=8, optimizer="rowwise_adagrad", model="dlrm"
    )
    cfg.check_schema(schema, None)
    tables, _ = cfg.layout(schema)
    assert [t.row_width for t in tables] == [16, 9]
    with pytest.raises(ConfigError, match="bsp and bounded"):
        cfg.with_flags(consistency="hybrid").check_schema(schema, None)
