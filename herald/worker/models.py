"""Models used by ``herald train``: DLRM for Criteo-shaped data, NCF for two-table data.

Both take the dense features ``[B, D]`` and the pooled embeddings ``[B, T, dim]``
(one sum-pooled vector per table, produced by :class:`herald.worker.api.CachedEmbedding`)
and return logits ``[B]``. Embedding tables live in the worker cache and the PS,
never in the model: the model holds only dense parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from herald.errors import ConfigError


def _mlp(sizes: list[int], *, last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


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

    def __init__(self, dense_dim: int, num_tables: int, embedding_dim: int,
                 bottom_mlp: tuple[int, ...] = (64,), top_mlp: tuple[int, ...] = (64, 32)):
        super().__init__()
        if num_tables < 1 or embedding_dim < 1:
            raise ConfigError("DLRM needs at least one table and embedding_dim >= 1")
        self.dense_dim = dense_dim
        self.bottom = _mlp([dense_dim, *bottom_mlp, embedding_dim], last_activation=True) if dense_dim else None
        n = num_tables + (1 if dense_dim else 0)
        self._pairs = torch.triu_indices(n, n, offset=1)
        top_in = (embedding_dim if dense_dim else 0) + n * (n - 1) // 2
        self.top = _mlp([top_in, *top_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        feats = [emb]
        x = None
        if self.bottom is not None:
            x = self.bottom(dense)
            feats = [x.unsqueeze(1), emb]
        z = torch.cat(feats, dim=1)                       # [B, n, dim]
        inter = torch.bmm(z, z.transpose(1, 2))           # [B, n, n]
        flat = inter[:, self._pairs[0], self._pairs[1]]   # [B, n(n-1)/2]
        top_in = flat if x is None else torch.cat([x, flat], dim=1)
        return self.top(top_in).squeeze(1)


class NCF(nn.Module):
    """Neural collaborative filtering (He et al. 2017, NeuMF) for two tables (user, item).

    The GMF part multiplies the two embeddings element-wise; the MLP part runs over
    their concatenation (and the dense features, if any); a linear layer combines both.

    Forward: ``dense [B, D]``, ``emb [B, 2, dim]`` -> logits ``[B]``.
    """

    def __init__(self, dense_dim: int, num_tables: int, embedding_dim: int, mlp: tuple[int, ...] = (64, 32)):
        super().__init__()
        if num_tables != 2:
            raise ConfigError(f"NCF needs exactly 2 tables (user, item), got {num_tables}; use --model dlrm")
        self.mlp = _mlp([2 * embedding_dim + dense_dim, *mlp], last_activation=True)
        self.out = nn.Linear(embedding_dim + mlp[-1], 1)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        user, item = emb[:, 0], emb[:, 1]
        h = self.mlp(torch.cat([user, item, dense], dim=1))
        return self.out(torch.cat([user * item, h], dim=1)).squeeze(1)


MODELS = {"dlrm": DLRM, "ncf": NCF}


def build_model(name: str, dense_dim: int, num_tables: int, embedding_dim: int, seed: int) -> nn.Module:
    """Build model ``name`` (``dlrm`` | ``ncf`` | ``auto``) with parameters drawn from ``seed``.

    ``auto`` picks NCF for two tables without dense features, else DLRM.

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
        return MODELS[name](dense_dim, num_tables, embedding_dim)
    finally:
        torch.random.set_rng_state(gen_state)
