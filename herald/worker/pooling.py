"""What the model sees of each feature: its bag sum-pooled, mean-pooled, or kept as a
sequence (NOTE [tables and features] in herald/contracts/features.py).

The lookups (:meth:`~herald.worker.executor.PlanExecutor.lookup`, a protocol's own) sum-pool
every bag; :class:`FeaturePooling` turns that into each feature's pooling with torch
operations, so gradients flow back through autograd to the step's rows:

- ``mean``: the sum divided by the bag's length (an empty bag: 0 / 1 = zeros), what
  ``F.embedding_bag(mode="mean")`` gives;
- ``none``: the bag's rows in order, padded to ``max_length`` (the last ``max_length`` of a
  longer bag), with the lengths.

The single-process reference (herald/job/reference.py) and the evaluation pool through
the same functions, so a job with mean-pooled features is exact against it to the bit; for a
model reading :class:`FeatureEmbeddings` (DIN) they build them for a whole batch with
:func:`features_from_rows`, the same truncation and padding as :meth:`FeaturePooling.features_of`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from herald.contracts.features import FeatureConfig
from herald.errors import ConfigError


def mean_divisor(offsets_flat: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """float32 [b, T]: the divisor of each pooled bag: its length (at least 1) for the
    features ``mean`` (bool [T]), 1 elsewhere.

    Args:
        offsets_flat: int64 [T, b + 1]: feature t's bag i is its values ``offsets[t, i]:offsets[t, i + 1]``.
    """
    lengths = np.diff(offsets_flat, axis=1).T  # [b, T]
    return np.where(mean[None, :], np.maximum(lengths, 1), 1).astype(np.float32)


def pool_mean(pooled: torch.Tensor, offsets_flat: np.ndarray, mean: np.ndarray) -> torch.Tensor:
    """``pooled`` (float32 [b, T, dim], bags summed) with the features ``mean`` divided by
    their bags' lengths (:func:`mean_divisor`); ``pooled`` itself when none is."""
    if not mean.any():
        return pooled
    divisor = torch.from_numpy(mean_divisor(offsets_flat, mean)).to(pooled.device)
    return pooled / divisor[:, :, None]


def model_input(pooled: list[torch.Tensor], offsets_flat: np.ndarray, mean: np.ndarray) -> torch.Tensor:
    """What a zoo model reads, from each feature's summed bags ``pooled[f]`` (float32 [b, dim_f]):
    the features with ``mean`` (bool [T]) divided by their bags' lengths, then stacked as
    float32 [b, T, dim] when the widths are equal, else concatenated as float32 [b, sum dim_f]
    (the one-process form of :meth:`FeaturePooling.pooled`: the same arithmetic, to the bit).

    Args:
        offsets_flat: int64 [T, b + 1]: each feature's bags.
    """
    if len({p.shape[1] for p in pooled}) <= 1:
        return pool_mean(torch.stack(pooled, dim=1), offsets_flat, mean)
    divisor = torch.from_numpy(mean_divisor(offsets_flat, mean))
    return torch.cat([p / divisor[:, f, None] if mean[f] else p for f, p in enumerate(pooled)], dim=1)


def batch_table_ids(
    values: list[np.ndarray], feature_tables: tuple[int, ...], num_tables: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A whole batch's keys as one process sees them (the reference, the evaluation).

    Args:
        values: uint64 [nnz_f] per feature (a :class:`~herald.loader.batch.SampleBatch`'s);
            feature_tables: the table of each feature; num_tables: the job's tables.

    Returns:
        ``(ids, inverse)``: ``ids[t]`` uint64, the sorted distinct ids of table t over every
        feature reading it; ``inverse[f]`` int64 [nnz_f], each value's index into its table's ids.
    """
    ids: list[np.ndarray] = []
    inverse: list[np.ndarray] = [np.zeros(0, np.int64)] * len(values)
    for t in range(num_tables):
        feats = [f for f, ft in enumerate(feature_tables) if ft == t]
        u, inv = np.unique(np.concatenate([values[f] for f in feats]), return_inverse=True)
        ids.append(u)
        at = 0
        for f in feats:
            n = values[f].shape[0]
            inverse[f] = inv[at : at + n].astype(np.int64)
            at += n
    return ids, inverse


@dataclasses.dataclass
class PaddedSequence:
    """One sequence feature of a micro-batch.

    Attributes:
        values: float32 [b, L, dim]: sample i's rows at ``values[i, :lengths[i]]``, in the
            bag's order; zeros beyond (``L`` = the feature's ``max_length``).
        lengths: int64 [b] on the same device (at most ``L``).
    """

    values: torch.Tensor
    lengths: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        """bool [b, L]: True at the rows that are there."""
        steps = torch.arange(self.values.shape[1], device=self.lengths.device)
        return steps[None, :] < self.lengths[:, None]


def sequence_index(
    offsets: np.ndarray, value_rows: np.ndarray, max_length: int, pad: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Where each padded position of one feature's sequences reads.

    Args:
        offsets: int64 [b + 1]: the feature's bags; value_rows: int64 [nnz]: the row of each
            of its values among the step's rows; max_length: ``L``; pad: the row index that reads zeros.

    Returns:
        ``(index int64 [b * L], lengths int64 [b], truncated)``: position ``(i, j)`` reads row
        ``index[i * L + j]``; ``truncated`` bags were longer than ``L`` (their last ``L`` kept).
    """
    lengths = np.diff(offsets)
    keep = np.minimum(lengths, max_length)
    first = offsets[1:] - keep  # the last `keep` values of each bag
    steps = np.arange(max_length, dtype=np.int64)
    at = first[:, None] + steps[None, :]
    there = steps[None, :] < keep[:, None]
    rows = np.where(there, value_rows[np.where(there, at, 0)] if value_rows.size else pad, pad)
    return rows.reshape(-1).astype(np.int64), keep.astype(np.int64), int((lengths > max_length).sum())


class FeatureEmbeddings(Mapping):
    """A micro-batch's features as the model asks for them: ``emb["C1"]`` is a pooled
    feature's float32 [b, dim] tensor, ``emb["history"]`` a sequence feature's
    :class:`PaddedSequence`; iterating gives the feature names in source order.

    Attributes:
        pooled: feature name -> float32 [b, dim] (sum or mean pooled);
        sequences: feature name -> :class:`PaddedSequence`.
    """

    def __init__(self, names: tuple[str, ...], pooled: dict[str, torch.Tensor], sequences: dict[str, PaddedSequence]):
        self.names, self.pooled, self.sequences = names, pooled, sequences

    def __getitem__(self, name: str):
        if name in self.pooled:
            return self.pooled[name]
        if name in self.sequences:
            return self.sequences[name]
        raise KeyError(f"no feature {name!r}; the features are {list(self.names)[:40]}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def to_keyed_tensor(self):
        """The pooled features as a ``torchrec.KeyedTensor`` (keys in source order, each its
        width), what an ``EmbeddingBagCollection`` returns.

        Raises:
            ImportError: torchrec is not installed (the message gives the install).
        """
        from herald.loader.torchrec_interop import keyed_tensor_class

        keys = [n for n in self.names if n in self.pooled]
        values = [self.pooled[k] for k in keys]
        return keyed_tensor_class()(
            keys=keys, length_per_key=[v.shape[1] for v in values], values=torch.cat(values, dim=1), key_dim=1
        )

    def to_jagged(self, name: str):
        """Sequence feature ``name`` as a ``torchrec.JaggedTensor`` (values [sum lengths, dim],
        lengths), what an ``EmbeddingCollection`` returns per feature.

        Raises:
            KeyError: not a sequence feature. ImportError: torchrec is not installed.
        """
        from herald.loader.torchrec_interop import jagged_tensor_class

        if name not in self.sequences:
            raise KeyError(f"{name!r} is not a sequence feature; the sequences are {sorted(self.sequences)}")
        seq = self.sequences[name]
        return jagged_tensor_class()(values=seq.values[seq.mask], lengths=seq.lengths)


class FeaturePooling:
    """Each feature's pooling over a micro-batch's sum-pooled bags (module docstring).

    Args:
        features: one :class:`FeatureConfig` per feature of the micro-batches (``JobSpec.feature_list``).
        dims: each feature's width (``JobSpec.feature_dims``); None: the lookup's width for every
            feature. The lookup's rows are padded to the widest (NOTE [mixed widths] in
            herald/ps/router.py): each feature keeps its first ``dims[f]`` columns.
    """

    def __init__(self, features: tuple[FeatureConfig, ...], dims: tuple[int, ...] | None = None):
        self.features = tuple(features)
        self.dims = None if dims is None or len(set(dims)) <= 1 else tuple(int(d) for d in dims)
        self.names = tuple(f.name for f in self.features)
        self.mean = np.array([f.pooling == "mean" for f in self.features], bool)
        self.has_sequences = any(f.is_sequence for f in self.features)
        self.truncated = 0  # sequence bags longer than max_length seen so far

    def check_tensor_output(self) -> None:
        """Raise unless every feature is pooled (what the ``[b, T, dim]`` tensor can hold)."""
        if self.has_sequences:
            seqs = [f.name for f in self.features if f.is_sequence]
            raise ConfigError(
                f"the job has sequence features {seqs[:10]}: a [b, T, dim] tensor cannot hold them; "
                "use ScheduledLoader.embedding(output='features')"
            )

    def pooled(self, pooled: torch.Tensor, offsets_flat: np.ndarray) -> torch.Tensor:
        """The sum-pooled bags (float32 [b, T, widest dim]) with each feature's pooling
        (:func:`pool_mean`): float32 [b, T, dim] when the widths are equal, else each feature's
        columns concatenated, float32 [b, sum dim_f] (what :func:`model_input` gives)."""
        out = pool_mean(pooled, offsets_flat, self.mean)
        if self.dims is None:
            return out
        return torch.cat([out[:, f, :d] for f, d in enumerate(self.dims)], dim=1)

    def features_of(
        self, pooled: torch.Tensor, rows: torch.Tensor, mb, value_rows: np.ndarray | None
    ) -> FeatureEmbeddings:
        """The :class:`FeatureEmbeddings` of micro-batch ``mb``.

        Args:
            pooled: float32 [b, T, dim], the sum-pooled bags; rows: float32 [n, dim], the
                step's distinct rows (requires grad); value_rows: int64 [N], the row of each
                value of ``mb`` (:class:`~herald.worker.rows.StepKeys`; None: no sequence read).

        Raises:
            ConfigError: a sequence feature without ``value_rows`` (a protocol that pools itself).
        """
        pooled = pool_mean(pooled, mb.offsets_flat, self.mean)
        dims = self.dims or (pooled.shape[2],) * len(self.features)
        out, seqs = {}, {}
        padded = None
        for t, f in enumerate(self.features):
            if not f.is_sequence:
                out[f.name] = pooled[:, t, : dims[t]]
                continue
            if padded is None:  # one zero row to read at the padding
                padded = torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])
            if value_rows is None:
                raise ConfigError(f"sequence feature {f.name!r}: this consistency mode pools the rows itself")
            ib = mb.inverse_bounds
            index, lengths, cut = sequence_index(
                mb.offsets_flat[t], value_rows[ib[t] : ib[t + 1]], f.max_length, rows.shape[0]
            )
            self.truncated += cut
            values = padded.index_select(0, torch.from_numpy(index).to(rows.device))
            values = values.view(len(mb), f.max_length, rows.shape[1])[:, :, : dims[t]]
            seqs[f.name] = PaddedSequence(values, torch.from_numpy(lengths).to(rows.device))
        return FeatureEmbeddings(self.names, out, seqs)


def features_from_rows(
    rows: list[torch.Tensor],
    inverse: list[np.ndarray],
    offsets: list[np.ndarray],
    feature_tables: tuple[int, ...],
    features: tuple[FeatureConfig, ...],
) -> FeatureEmbeddings:
    """A whole batch's :class:`FeatureEmbeddings` in one process (the reference, the evaluation):
    what :meth:`FeaturePooling.features_of` gives a worker for its micro-batch.

    Pooled features: their bags summed (``F.embedding_bag``) and divided by their lengths where
    ``mean`` (:func:`pool_mean`, as the reference pools every feature); sequences: each bag's
    last ``max_length`` rows in order, zeros beyond (:func:`sequence_index`).

    Args:
        rows: float32 [n_t, dim] per table: table t's distinct rows of the batch, in the order of
            :func:`batch_table_ids`'s ``ids[t]`` (may require grad: gradients flow back to them).
        inverse: int64 [nnz_f] per feature, each value's row in its table's ``rows``
            (:func:`batch_table_ids`); offsets: int64 [b + 1] per feature (its bags).
        feature_tables: the table of each feature; features: one :class:`FeatureConfig` each.

    Returns:
        the :class:`FeatureEmbeddings` (pooled float32 [b, dim], sequences [b, L, dim] + lengths).
    """
    b = offsets[0].shape[0] - 1 if offsets else 0
    names = tuple(f.name for f in features)
    pooled_at = [i for i, f in enumerate(features) if not f.is_sequence]
    out: dict[str, torch.Tensor] = {}
    if pooled_at:
        bags = [
            F.embedding_bag(
                torch.from_numpy(inverse[i]), rows[feature_tables[i]], torch.from_numpy(offsets[i][:-1]), mode="sum"
            )
            for i in pooled_at
        ]
        mean = np.array([features[i].pooling == "mean" for i in pooled_at], bool)
        stacked = pool_mean(torch.stack(bags, dim=1), np.stack([offsets[i] for i in pooled_at]), mean)
        out = {features[i].name: stacked[:, k] for k, i in enumerate(pooled_at)}
    seqs: dict[str, PaddedSequence] = {}
    for i, f in enumerate(features):
        if not f.is_sequence:
            continue
        table = rows[feature_tables[i]]
        padded = torch.cat([table, table.new_zeros((1, table.shape[1]))])  # one zero row read at the padding
        index, lengths, _ = sequence_index(offsets[i], inverse[i], f.max_length, table.shape[0])
        values = padded.index_select(0, torch.from_numpy(index))
        seqs[f.name] = PaddedSequence(values.view(b, f.max_length, table.shape[1]), torch.from_numpy(lengths))
    return FeatureEmbeddings(names, out, seqs)
