"""Models used by ``herald train``: DLRM, Wide&Deep, DeepFM, DCN v2, NCF and DIN.

Every model takes the dense features ``[B, D]`` and the pooled embeddings
``[B, T, dim]`` (one sum-pooled row per table, produced by
:class:`herald.worker.api.CachedEmbedding` from the worker cache, or by the
single-process reference) and returns logits ``[B]``. Embedding tables live in the
worker cache and the PS, never in the model: the model holds only dense parameters,
which ``DenseSync`` all-reduces. DIN (herald/worker/din.py) reads a history sequence: its
forward takes a :class:`~herald.worker.pooling.FeatureEmbeddings` instead
(:attr:`herald.contracts.models.ModelNeeds.reads_features`).

NOTE [scalar slice]: Wide&Deep's wide part and DeepFM's first-order term need one
scalar weight per id. These models take one width for every feature (``JobSpec.dim``),
so a separate dim-1 table does not fit them; instead they read the *last element* of each table's row as the id's scalar
weight and the first ``dim - 1`` elements as its embedding vector. The scalar is then
pulled, cached, pushed, sum-pooled (a multi-hot field sums its ids' weights: the
linear term of the one-hot encoding) and updated by the sparse optimizer exactly like
the rest of the row, so BSP exactness needs nothing new. With ``rowwise_adagrad`` the
scalar shares the row's accumulator. ``--embedding-dim 17`` gives 16-wide vectors.

Herald's workloads (Herald §2.2, Table 1): W1 Criteo + Wide&Deep,
W2 MovieLens + NCF, W3 Avazu + DeepFM, W4 Criteo Sponsored Search + Deep&Cross; HET
trains WDL, DeepFM and DCN with 3 hidden layers of 256 (HET §5, Table 3),
the default deep part here. :func:`build_model` ``auto`` keeps the shape rule; the
job resolves ``auto`` by dataset first (:func:`herald.contracts.train.auto_model`).

What each model needs of a job (its table count, the smallest ``--embedding-dim``) is
stated once, in :data:`herald.contracts.models.MODEL_NEEDS`: the constructors below check it
with :func:`herald.contracts.models.check_model`, as ``herald train`` does before any process starts.
"""

from __future__ import annotations

import torch
from torch import nn

from herald.contracts.features import FeatureConfig
from herald.contracts.models import MIXED_WIDTH_MODELS, check_model, mixed_width_error, reads_features
from herald.errors import ConfigError
from herald.worker.din import DIN

#: Hidden layers of the deep part of WDL, DeepFM and DCN (HET Table 3).
DEEP_MLP = (256, 256, 256)


def _mlp(sizes: list[int], *, last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def split_scalar(emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NOTE [scalar slice]: ``emb float32 [B, T, dim]`` -> (vectors ``[B, T, dim-1]``,
    scalar weights ``[B, T]``)."""
    return emb[..., :-1], emb[..., -1]


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019): bottom MLP over dense features, pairwise dot
    interaction between the bottom output and every table's embedding, top MLP.

    Args:
        dense_dim: number of dense features ``D`` (0 allowed: no bottom MLP).
        num_tables: number of embedding tables ``T``.
        embedding_dim: embedding dimension ``dim``.
        bottom_mlp: hidden sizes of the bottom MLP; its output size is ``dim``.
        top_mlp: hidden sizes of the top MLP (a final layer of size 1 is added).

    Forward: ``dense float32 [B, D]``, ``emb float32 [B, T, dim]`` -> logits ``[B]``.
    """

    def __init__(
        self,
        dense_dim: int,
        num_tables: int,
        embedding_dim: int,
        bottom_mlp: tuple[int, ...] = (64,),
        top_mlp: tuple[int, ...] = (64, 32),
    ):
        super().__init__()
        check_model("dlrm", num_tables, embedding_dim)  # what each model needs: herald/contracts/models.py
        self.dense_dim = dense_dim
        self.bottom = _mlp([dense_dim, *bottom_mlp, embedding_dim], last_activation=True) if dense_dim else None
        n = num_tables + (1 if dense_dim else 0)
        self._pairs = torch.triu_indices(n, n, offset=1)
        # the same pairs as positions in the flattened [n * n] interaction: one index_select
        # instead of advanced indexing with two index tensors (same values; its backward
        # ~1.7x faster at batch 256, 27 features: no accumulation, each position is picked once)
        self.register_buffer("_pair_index", self._pairs[0] * n + self._pairs[1], persistent=False)  # moves with .to()
        top_in = (embedding_dim if dense_dim else 0) + n * (n - 1) // 2
        self.top = _mlp([top_in, *top_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        feats = [emb]
        x = None
        if self.bottom is not None:
            x = self.bottom(dense)
            feats = [x.unsqueeze(1), emb]
        z = torch.cat(feats, dim=1)  # [B, n, dim]
        inter = torch.bmm(z, z.transpose(1, 2))  # [B, n, n]
        flat = inter.flatten(1).index_select(1, self._pair_index)  # [B, n(n-1)/2], pairs (i < j) row-major
        top_in = flat if x is None else torch.cat([x, flat], dim=1)
        return self.top(top_in).squeeze(1)


class WideAndDeep(nn.Module):
    """Wide & Deep (Cheng et al. 2016, §3; Herald workload W1 on Criteo).

    logit = wide + deep, where wide = sum over tables of the ids' scalar weights
    (NOTE [scalar slice]: the last element of each pooled row) + a linear term over the
    dense features, and deep = MLP over the concatenated embedding vectors (first
    ``dim - 1`` elements) and the dense features (§3.2). Both parts train jointly
    (§3.3): the wide weights by herald's sparse optimizer through the cache and PS, the
    rest by the dense optimizer. The paper's cross-product transformations are not
    built: give them as extra (hashed) tables of the data if wanted.

    Args:
        dense_dim: number of dense features ``D`` (>= 0).
        num_tables: number of embedding tables ``T`` (>= 1).
        embedding_dim: row width ``dim`` (>= 2): ``dim - 1`` vector + 1 wide weight.
        deep_mlp: hidden sizes of the deep part (a final layer of size 1 is added).

    Forward: ``dense float32 [B, D]``, ``emb float32 [B, T, dim]`` -> logits ``[B]``.

    Raises:
        ConfigError: no table or ``embedding_dim < 2``.
    """

    def __init__(self, dense_dim: int, num_tables: int, embedding_dim: int, deep_mlp: tuple[int, ...] = DEEP_MLP):
        super().__init__()
        check_model("wdl", num_tables, embedding_dim)
        self.wide_dense = nn.Linear(dense_dim, 1, bias=False) if dense_dim else None
        self.deep = _mlp([num_tables * (embedding_dim - 1) + dense_dim, *deep_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        vectors, weights = split_scalar(emb)
        wide = weights.sum(dim=1)
        if self.wide_dense is not None:
            wide = wide + self.wide_dense(dense).squeeze(1)
        deep = self.deep(torch.cat([vectors.flatten(1), dense], dim=1)).squeeze(1)
        return wide + deep


class DeepFM(nn.Module):
    """DeepFM (Guo et al. 2017, §2.1; Herald workload W3 on Avazu).

    logit = y_FM + y_DNN over fields sharing one embedding (§2.1): each table is a
    field whose vector is its pooled embedding vector (first ``dim - 1`` elements) and
    whose first-order weight is the scalar slice (NOTE [scalar slice]); each dense
    feature ``j`` is a numerical field with a learned vector ``V_j`` and weight
    ``w_j`` scaled by its value (§2.1, "x_j" of a continuous field). y_FM = bias +
    sum of first-order weights + sum over field pairs of ``<v_i, v_j>`` (computed as
    ``((sum v)^2 - sum v^2) / 2``); y_DNN = MLP over the concatenated field vectors.

    Args, forward and raises: those of :class:`WideAndDeep`, the other scalar-slice model
    (the last element of a row is here the first-order weight; ``deep_mlp`` sizes the DNN).
    """

    def __init__(self, dense_dim: int, num_tables: int, embedding_dim: int, deep_mlp: tuple[int, ...] = DEEP_MLP):
        super().__init__()
        check_model("deepfm", num_tables, embedding_dim)
        k = embedding_dim - 1
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_vectors = nn.Parameter(torch.empty(dense_dim, k).uniform_(-0.05, 0.05)) if dense_dim else None
        self.dense_weights = nn.Linear(dense_dim, 1, bias=False) if dense_dim else None
        self.deep = _mlp([(num_tables + dense_dim) * k, *deep_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        fields, weights = split_scalar(emb)  # [B, T, k], [B, T]
        first = weights.sum(dim=1) + self.bias
        if self.dense_vectors is not None:
            fields = torch.cat([fields, dense.unsqueeze(2) * self.dense_vectors], dim=1)  # [B, T + D, k]
            first = first + self.dense_weights(dense).squeeze(1)
        total = fields.sum(dim=1)
        second = 0.5 * (total * total - (fields * fields).sum(dim=1)).sum(dim=1)
        return first + second + self.deep(fields.flatten(1)).squeeze(1)


class CrossLayer(nn.Module):
    """One DCN v2 cross layer (Wang et al. 2021, §3.1, Eq. 1):
    ``x_{l+1} = x_0 * (W x_l + b) + x_l`` with a full-rank ``W`` (``[d, d]``).

    Forward: ``x0, x float32 [B, d]`` -> ``[B, d]``.
    """

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.linear(x) + x


class DCNv2(nn.Module):
    """Deep & Cross Network v2 (Wang et al. 2021, §3; Herald's W4 uses DCN, Wang et al. 2017).

    ``x_0`` = the dense features and every table's pooled embedding, concatenated
    (``d = D + T * dim``); ``cross_layers`` full-rank cross layers (§3.1), then the deep
    MLP over their output (the stacked structure, §3, Fig. 1), then one linear layer to
    the logit. DCN v1's cross layer is the rank-restricted case ``W = x_l w^T``.

    Args:
        dense_dim: number of dense features ``D`` (>= 0).
        num_tables: number of embedding tables ``T`` (>= 1).
        embedding_dim: embedding dimension ``dim`` (>= 1).
        cross_layers: number of cross layers (>= 1).
        deep_mlp: hidden sizes of the deep part (a final layer of size 1 is added).
        feature_dims: each feature's width when they differ (tables of several widths:
            docs/models.md, "Tables and features"); ``emb`` is then their concatenation.

    Forward: ``dense float32 [B, D]``, ``emb float32 [B, T, dim]`` (or ``[B, sum(feature_dims)]``)
    -> logits ``[B]``.

    Raises:
        ConfigError: no table, ``embedding_dim < 1`` or ``cross_layers < 1``.
    """

    def __init__(
        self,
        dense_dim: int,
        num_tables: int,
        embedding_dim: int,
        cross_layers: int = 3,
        deep_mlp: tuple[int, ...] = DEEP_MLP,
        feature_dims: tuple[int, ...] | None = None,
    ):
        super().__init__()
        check_model("dcn", num_tables, embedding_dim)
        if cross_layers < 1:
            raise ConfigError(f"DCN needs cross_layers >= 1, got {cross_layers}")
        width = dense_dim + (sum(feature_dims) if feature_dims else num_tables * embedding_dim)
        self.cross = nn.ModuleList(CrossLayer(width) for _ in range(cross_layers))
        self.deep = _mlp([width, *deep_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, emb.flatten(1)], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.deep(x).squeeze(1)


class NCF(nn.Module):
    """Neural collaborative filtering (He et al. 2017, NeuMF; Herald workload W2 on
    MovieLens) for two tables (user, item).

    The GMF part multiplies the two embeddings element-wise; the MLP part runs over
    their concatenation (and the dense features, if any); a linear layer combines both.

    Forward: ``dense [B, D]``, ``emb [B, 2, dim]`` -> logits ``[B]``.

    Raises:
        ConfigError: not exactly two tables.
    """

    def __init__(self, dense_dim: int, num_tables: int, embedding_dim: int, mlp: tuple[int, ...] = (64, 32)):
        super().__init__()
        check_model("ncf", num_tables, embedding_dim)
        self.mlp = _mlp([2 * embedding_dim + dense_dim, *mlp], last_activation=True)
        self.out = nn.Linear(embedding_dim + mlp[-1], 1)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        user, item = emb[:, 0], emb[:, 1]
        h = self.mlp(torch.cat([user, item, dense], dim=1))
        return self.out(torch.cat([user * item, h], dim=1)).squeeze(1)


MODELS = {"dlrm": DLRM, "wdl": WideAndDeep, "deepfm": DeepFM, "dcn": DCNv2, "ncf": NCF, "din": DIN}


def build_model(
    name: str,
    dense_dim: int,
    num_tables: int,
    embedding_dim: int,
    seed: int,
    feature_dims: tuple[int, ...] | None = None,
    features: tuple[FeatureConfig, ...] | None = None,
) -> nn.Module:
    """Build model ``name`` (``dlrm`` | ``wdl`` | ``deepfm`` | ``dcn`` | ``ncf`` | ``din`` | ``auto``)
    with parameters drawn from ``seed`` (equal replicas on every rank).

    ``auto`` here picks by shape: NCF for two tables without dense features, else DLRM
    (``herald train`` resolves ``auto`` by dataset before this: :func:`herald.contracts.train.auto_model`).

    Args:
        dense_dim: dense features per sample ``D``; num_tables: the features ``T`` of each
            sample (``JobSpec.num_features``: one per table unless features share tables);
        embedding_dim: row width ``dim`` of every table; seed: initialisation seed.
        feature_dims: each feature's width when the tables' widths differ (None: all
            ``embedding_dim``); only the models that concatenate the features take them (DCN).
        features: the job's features (``JobSpec.feature_list``), read by the models whose
            forward takes a ``FeatureEmbeddings`` (DIN; :func:`herald.contracts.models.reads_features`).

    Raises:
        ConfigError: unknown model name or a shape the model cannot take.
    """
    if name == "auto":
        name = "ncf" if num_tables == 2 and dense_dim == 0 else "dlrm"
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of {sorted(MODELS)} or 'auto'")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if feature_dims is not None and len(set(feature_dims)) > 1:
            if name not in MIXED_WIDTH_MODELS:
                raise ConfigError(mixed_width_error(name))
            return MODELS[name](dense_dim, num_tables, embedding_dim, feature_dims=tuple(feature_dims))
        if reads_features(name):
            return MODELS[name](dense_dim, num_tables, embedding_dim, features=tuple(features or ()))
        return MODELS[name](dense_dim, num_tables, embedding_dim)
    finally:
        torch.random.set_rng_state(gen_state)
