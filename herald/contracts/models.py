"""What each ``--model`` needs of the source's schema and of the settings, stated once.

:data:`MODEL_NEEDS` and :func:`check_model` are read by every place that decides whether a
model can train a job, so they cannot disagree:

- :meth:`herald.contracts.train.TrainConfig.check_schema`: ``herald train`` and ``herald serve
  dispatcher`` refuse a model the source cannot feed as soon as the source's schema is
  known, before any pass over the data and before any process starts
  (:class:`herald.job.data.JobData`);
- :class:`herald.contracts.job.JobSpec`, the contract every worker receives;
- the models themselves (:mod:`herald.worker.models`), for a caller that builds one directly.

Plain Python, like the rest of :mod:`herald.contracts` (no torch: the launcher checks without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from herald.contracts.features import FeatureConfig
from herald.contracts.vocab import MODELS, SCALAR_SLICE_MODELS
from herald.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelNeeds:
    """What one model needs of a job.

    Attributes:
        label: the model's name in messages (``NCF``, ``Wide&Deep``).
        tables: exactly this many embedding tables, or None: any number >= 1.
        tables_are: what those tables are, for the message (``"user, item"``).
        min_dim: the smallest ``--embedding-dim``: 2 for the models reading the last
            element of each row as the id's scalar weight (NOTE [scalar slice] in
            herald/worker/models.py: :data:`~herald.contracts.vocab.SCALAR_SLICE_MODELS`), else 1.
        sequence: the model reads one sequence feature (pooling ``none``) and a pooled feature
            reading the same table, its target (DIN: the history and the item scored against it).
        reads_features: its forward takes ``(dense [B, D], features:
            herald.worker.pooling.FeatureEmbeddings)`` (``ScheduledLoader.embedding(output="features")``),
            not the ``[B, T, dim]`` tensor of pooled features.
    """

    label: str
    tables: int | None = None
    tables_are: str = ""
    min_dim: int = 1
    sequence: bool = False
    reads_features: bool = False


def _needs(name: str, label: str, **kw) -> ModelNeeds:
    return ModelNeeds(label, min_dim=2 if name in SCALAR_SLICE_MODELS else 1, **kw)


#: Every model of ``--model`` but ``auto`` (resolved first: :func:`herald.contracts.train.auto_model`).
MODEL_NEEDS: dict[str, ModelNeeds] = {
    "dlrm": _needs("dlrm", "DLRM"),
    "wdl": _needs("wdl", "Wide&Deep"),
    "deepfm": _needs("deepfm", "DeepFM"),
    "dcn": _needs("dcn", "DCN"),
    "ncf": _needs("ncf", "NCF", tables=2, tables_are="user, item"),
    "din": _needs("din", "DIN", sequence=True, reads_features=True),
}


def reads_features(model: str) -> bool:
    """Whether ``model``'s forward takes a ``FeatureEmbeddings`` (:attr:`ModelNeeds.reads_features`;
    ``auto`` and the other models take the ``[B, T, dim]`` tensor)."""
    needs = MODEL_NEEDS.get(model)
    return needs is not None and needs.reads_features


def sequence_and_target(features: Sequence[FeatureConfig]) -> tuple[int, int] | None:
    """``(s, a)``: the index of the only sequence feature and of the first pooled feature reading
    its table (the target item a sequence model scores against its history), or None when
    ``features`` have not exactly one sequence feature or no such pooled feature."""
    seqs = [i for i, f in enumerate(features) if f.is_sequence]
    if len(seqs) != 1:
        return None
    table = features[seqs[0]].table
    targets = [i for i, f in enumerate(features) if not f.is_sequence and f.table == table]
    return (seqs[0], targets[0]) if targets else None


if set(MODEL_NEEDS) != set(MODELS) - {"auto"}:  # the vocabulary and this table name the same models
    raise ImportError(
        f"herald.contracts.models: MODEL_NEEDS {sorted(MODEL_NEEDS)} and herald.contracts.vocab.MODELS "
        f"{sorted(MODELS)} (less 'auto') differ: give every model one entry"
    )


#: The models that take tables of several widths: they concatenate the features (DCN v2's
#: x_0). DLRM's dot interactions, DeepFM's FM, NCF's GMF product and Wide&Deep's scalar slice
#: need one width.
MIXED_WIDTH_MODELS = ("dcn",)


def mixed_width_error(model: str) -> str:
    """The message refusing ``model`` for tables of several widths, naming the fix."""
    label = MODEL_NEEDS[model].label if model in MODEL_NEEDS else model
    return (
        f"--model {model} ({label}) needs every table at one width (its interactions multiply features "
        f"pairwise); with tables of several widths use --model {' or '.join(MIXED_WIDTH_MODELS)} (it concatenates "
        "them), give every table the same dim, or train your own model with --script"
    )


def check_model(
    model: str,
    num_tables: int | None,
    embedding_dim: int,
    *,
    chosen_as: str | None = None,
    table_names: tuple[str, ...] | None = None,
    features: Sequence[FeatureConfig] | None = None,
) -> None:
    """Raise unless ``model`` can train ``num_tables`` tables of rows ``embedding_dim`` wide,
    naming the flags (``--model``, ``--embedding-dim``) and the fix.

    Args:
        model: a name of :data:`MODEL_NEEDS`, or ``auto`` (left to the shape rule of
            :func:`herald.worker.models.build_model`, which only picks a model the shape
            fits: only the table count is checked).
        num_tables: the source's tables ``T``; None: not known yet (only the dim is checked).
        embedding_dim: ``dim`` of every row (``--embedding-dim``).
        chosen_as: what the user asked for when ``model`` is its resolution (``"auto"``:
            the message says ``--model auto (here ncf)``).
        table_names: the source's table names, for the message (the first few are shown).
        features: the job's features (NOTE [tables and features] in herald/contracts/features.py),
            checked for a :attr:`ModelNeeds.sequence` model; None: not known yet.

    Raises:
        ConfigError: no table, a table count the model cannot take, a row too narrow, or (DIN)
            features without one sequence and a pooled feature reading its table.
    """
    named = f"--model {model}" if chosen_as in (None, model) else f"--model {chosen_as} (here {model})"
    if num_tables is not None and num_tables < 1:
        raise ConfigError(f"{named} needs at least one embedding table (an id column), the source has none")
    needs = MODEL_NEEDS.get(model)
    if needs is None:  # auto: build_model picks by shape
        return
    if num_tables is not None and needs.tables is not None and num_tables != needs.tables:
        shown = ""
        if table_names:
            shown = ": " + ", ".join(table_names[:4]) + (", ..." if len(table_names) > 4 else "")
        others = ", ".join(m for m, n in MODEL_NEEDS.items() if n.tables is None and not n.sequence)
        raise ConfigError(
            f"{named} ({needs.label}) needs exactly {needs.tables} tables ({needs.tables_are}), and "
            f"the source has {num_tables}{shown}; choose --model {others} (or auto), or a source of "
            f"{needs.tables} id columns"
        )
    if embedding_dim < needs.min_dim:
        why = (
            " (the last element of each row is the id's scalar weight: NOTE [scalar slice], docs/models.md)"
            if model in SCALAR_SLICE_MODELS
            else ""
        )
        raise ConfigError(
            f"{named} needs --embedding-dim >= {needs.min_dim}{why}, got {embedding_dim}; set "
            f"--embedding-dim {needs.min_dim} or more, or choose another --model"
        )
    if needs.sequence and features is not None and sequence_and_target(features) is None:
        shown = ", ".join(f"{f.name} ({f.table}, {f.pooling})" for f in list(features)[:6])
        raise ConfigError(
            f'{named} ({needs.label}) needs exactly one sequence feature (pooling "none", e.g. a user\'s '
            "history) and a pooled feature reading the same table (the target item it is scored against); "
            f"the features are: {shown}{', ...' if len(features) > 6 else ''}. On a MovieLens ratings file "
            "--model din declares them itself (genres, a history of --source-option history=20); for another "
            'source declare them with --tables FILE ([features.history] table = "items", pooling = "none", '
            'max_length = 20, and the target feature reading table "items"): docs/models.md'
        )
