"""DIN, the Deep Interest Network (Zhou et al., KDD'18), as ``herald train --model din``.

A user's interest is not one fixed vector: it depends on the item being scored. DIN's local
activation unit (Zhou et al., KDD'18 §4.3, Fig. 2) gives each behaviour ``e_j`` of the user's
history a weight computed from it and the target item ``e_a``, by a small MLP over
``[e_j, e_a, e_j - e_a, e_j * e_a]`` (the paper's inputs and their out product; here the
element-wise product and difference, as the authors' released code does); the weights are
*not* softmax-normalised (§4.3: "normalization with softmax ... is abandoned", to keep the
intensity of the user's interests), and padding positions get weight 0. The interest vector
``v_U = sum_j w_j e_j`` then goes with the target item, the other pooled features and the dense
features through an MLP to one logit (§4.3, Fig. 2: 200-80 there; 80-40 here by default, for
MovieLens-sized data).

Activations are PReLU (§4.3; one slope per unit). The paper's Dice (§5.2) normalises by the
mini-batch's statistics: a worker's micro-batch and the global batch would then see different
statistics and BSP training would no longer equal one process (Herald §3.3), so it is not used.

What DIN reads of a job (:data:`herald.contracts.models.MODEL_NEEDS`): exactly one sequence
feature (pooling ``none``: the history) and a pooled feature reading the same table (the
target: its first one, in source order); every other feature must be pooled and is an input
of the MLP. On MovieLens, ``herald train --model din`` lays this out itself (NOTE [din layout]
in herald/contracts/train.py): ``item`` is the target, ``history`` the sequence (the user's
previously rated movies, most recent ``L``), ``user`` and mean-pooled ``genres`` the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from herald.contracts.features import FeatureConfig
from herald.contracts.models import check_model, sequence_and_target
from herald.errors import ConfigError

#: Hidden sizes of the local activation unit (Zhou et al., KDD'18 Fig. 2: one layer of 36).
ATTENTION_MLP = (36,)
#: Hidden sizes of DIN's MLP (the paper's 200-80, scaled to MovieLens).
DIN_MLP = (80, 40)


def prelu_mlp(sizes: Sequence[int]) -> nn.Sequential:
    """Linear layers of ``sizes`` with a PReLU (one slope per unit) after each but the last."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.PReLU(sizes[i + 1]))
    return nn.Sequential(*layers)


class DIN(nn.Module):
    """Deep Interest Network (Zhou et al., KDD'18 §4.3; module docstring).

    Args:
        dense_dim: dense features per sample ``D`` (>= 0).
        num_tables: the job's features ``T`` (``len(features)``; the name is the zoo's).
        embedding_dim: row width ``dim`` of every table.
        features: the job's features, in micro-batch order (``JobSpec.feature_list``).
        attention_mlp: hidden sizes of the local activation unit (a final layer of size 1 is added).
        mlp: hidden sizes of the MLP (a final layer of size 1 is added).

    Forward: ``dense float32 [B, D]``, ``features``: a mapping from feature name to a pooled
    float32 ``[B, dim]`` tensor or, for the sequence, a
    :class:`~herald.worker.pooling.PaddedSequence` (``values [B, L, dim]``, ``mask [B, L]``):
    a :class:`~herald.worker.pooling.FeatureEmbeddings` -> logits ``[B]``.

    Raises:
        ConfigError: features DIN cannot read (:func:`herald.contracts.models.check_model`:
            not exactly one sequence and a pooled feature of its table), or ``T != len(features)``.
    """

    def __init__(
        self,
        dense_dim: int,
        num_tables: int,
        embedding_dim: int,
        features: Sequence[FeatureConfig] = (),
        attention_mlp: tuple[int, ...] = ATTENTION_MLP,
        mlp: tuple[int, ...] = DIN_MLP,
    ):
        super().__init__()
        features = tuple(features)
        check_model("din", num_tables, embedding_dim, features=features)
        if num_tables != len(features):
            raise ConfigError(f"DIN: {num_tables} features given as num_tables, but {len(features)} FeatureConfigs")
        found = sequence_and_target(features)
        if found is None:  # check_model has raised already; kept for the type checker
            raise ConfigError("DIN needs one sequence feature and a pooled feature reading its table")
        seq, target = found
        self.sequence, self.target = features[seq].name, features[target].name
        self.others = tuple(f.name for i, f in enumerate(features) if i not in (seq, target))
        d = embedding_dim
        self.attention = prelu_mlp([4 * d, *attention_mlp, 1])
        self.mlp = prelu_mlp([(2 + len(self.others)) * d + dense_dim, *mlp, 1])

    def interest(self, history, target: torch.Tensor) -> torch.Tensor:
        """float32 [B, dim]: ``sum_j w_j e_j`` over the rows there (Zhou et al., KDD'18 Eq. 3),
        ``w_j`` the activation unit's output for ``(e_j, target)``, no softmax, 0 at the padding.

        Args:
            history: a :class:`~herald.worker.pooling.PaddedSequence`; target: float32 [B, dim].
        """
        keys = history.values  # [B, L, dim]
        query = target.unsqueeze(1).expand_as(keys)
        unit_in = torch.cat([keys, query, keys - query, keys * query], dim=2)  # [B, L, 4 dim]
        # flattened to [B * L, 4 dim]: PReLU's slopes are per channel, dimension 1
        w = self.attention(unit_in.flatten(0, 1)).view(keys.shape[0], keys.shape[1])  # [B, L]
        w = torch.where(history.mask, w, torch.zeros_like(w))
        return torch.bmm(w.unsqueeze(1), keys).squeeze(1)

    def forward(self, dense: torch.Tensor, features: Mapping) -> torch.Tensor:
        target = features[self.target]
        parts = [self.interest(features[self.sequence], target), target]
        parts += [features[name] for name in self.others]
        return self.mlp(torch.cat([*parts, dense], dim=1)).squeeze(1)
