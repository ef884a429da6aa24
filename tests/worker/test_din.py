"""DIN (herald/worker/din.py; Zhou et al., KDD'18 §4.3): the activation unit's weights
without softmax, masked at the padding, what it needs of a job's features, and the
one-process FeatureEmbeddings (:func:`herald.worker.pooling.features_from_rows`) equal to a
worker's (:meth:`FeaturePooling.features_of`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from herald.contracts.features import FeatureConfig
from herald.errors import ConfigError
from herald.worker.din import DIN
from herald.worker.models import build_model
from herald.worker.pooling import FeaturePooling, PaddedSequence, batch_table_ids, features_from_rows
from tests.worker.test_models import DIN_FEATURES

B, DIM, L = 6, 4, 6


def _features(seed=0, lengths=(0, 1, 3, 6, 6, 2)):
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(B, L, DIM, generator=gen) - 0.5
    lengths_t = torch.tensor(lengths)
    mask = torch.arange(L)[None, :] < lengths_t[:, None]
    values = torch.where(mask[:, :, None], values, torch.zeros_like(values))
    pooled = {n: (torch.rand(B, DIM, generator=gen) - 0.5) for n in ("user", "item", "genres")}
    return {**pooled, "history": PaddedSequence(values.requires_grad_(True), lengths_t)}


def test_interest_is_the_unnormalised_weighted_sum_of_the_behaviours_there():
    model = build_model("din", 2, 4, DIM, seed=3, features=DIN_FEATURES)
    feats = _features()
    seq, item = feats["history"], feats["item"]
    got = model.interest(seq, item)
    for i in range(B):
        n = int(seq.lengths[i])
        keys = seq.values[i, :n]
        q = item[i].expand_as(keys)
        w = model.attention(torch.cat([keys, q, keys - q, keys * q], dim=1)).squeeze(1)  # no softmax
        want = (w[:, None] * keys).sum(dim=0) if n else torch.zeros(DIM)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
    # the padding weighs nothing: changing it changes nothing
    other = PaddedSequence(seq.values.detach() + (~seq.mask)[:, :, None] * 7.0, seq.lengths)
    torch.testing.assert_close(model.interest(other, item), got.detach())


def test_forward_reads_every_input_and_gives_one_logit_per_sample():
    model = build_model("din", 2, 4, DIM, seed=1, features=DIN_FEATURES)
    feats = _features()
    dense = torch.rand(B, 2)
    logits = model(dense, feats)
    assert logits.shape == (B,)
    F.binary_cross_entropy_with_logits(logits, torch.ones(B)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing, f"no gradient reaches {missing}"
    grad = feats["history"].values.grad
    assert bool((grad[feats["history"].mask].abs().sum(dim=1) > 0).all())
    assert bool((grad[~feats["history"].mask] == 0).all()), "the padding got a gradient"
    assert (model.sequence, model.target, model.others) == ("history", "item", ("user", "genres"))


def test_a_tiny_training_run_learns_the_history_against_the_target():
    """Label 1 when the target item is in the history: only the attention can tell."""
    gen = torch.Generator().manual_seed(0)
    n, items = 256, 12
    hist = torch.randint(0, items, (n, L), generator=gen)
    lengths = torch.randint(1, L + 1, (n,), generator=gen)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    target = torch.randint(0, items, (n,), generator=gen)
    labels = ((hist == target[:, None]) & mask).any(dim=1).float()
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(items, DIM) * 0.5)
    model = DIN(0, 2, DIM, (FeatureConfig("item", "i"), FeatureConfig("history", "i", "none", L)))
    opt = torch.optim.Adam([table, *model.parameters()], lr=0.02)
    losses = []
    for _ in range(150):
        seq = PaddedSequence(table[hist] * mask[:, :, None], lengths)
        loss = F.binary_cross_entropy_with_logits(
            model(torch.zeros(n, 0), {"item": table[target], "history": seq}), labels
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], f"loss went {losses[0]:.3f} -> {losses[-1]:.3f}"


@pytest.mark.parametrize(
    "features,match",
    [
        ((FeatureConfig("a", "a"), FeatureConfig("b", "b")), "exactly one sequence feature"),
        ((FeatureConfig("a", "a"), FeatureConfig("h", "b", "none", 3)), "pooled feature reading the same table"),
        (
            (FeatureConfig("a", "t"), FeatureConfig("h", "t", "none", 3), FeatureConfig("g", "t", "none", 3)),
            "exactly one sequence",
        ),
        ((), "--tables FILE"),
    ],
)
def test_what_din_needs_is_said_with_the_fix(features, match):
    with pytest.raises(ConfigError, match=match):
        build_model("din", 0, len(features) or 2, DIM, seed=0, features=features)


def test_one_process_features_equal_a_workers():
    """features_from_rows over a batch's distinct rows equals FeaturePooling.features_of over
    a micro-batch's step rows: same pooling, same truncation (the last max_length), same padding."""
    feats = (FeatureConfig("item", "m"), FeatureConfig("genres", "g", "mean"), FeatureConfig("history", "m", "none", 3))
    rng = np.random.default_rng(0)
    b = 5
    lens = [np.ones(b, np.int64), rng.integers(0, 4, b), np.array([0, 1, 3, 5, 2])]
    offsets = [np.concatenate([[0], np.cumsum(n)]).astype(np.int64) for n in lens]
    values = [rng.integers(1, 9, int(o[-1])).astype(np.uint64) for o in offsets]
    uniq, inv = batch_table_ids(values, (0, 1, 0), 2)
    rows = [torch.rand(len(u), DIM) for u in uniq]
    got = features_from_rows(rows, inv, offsets, (0, 1, 0), feats)
    # a worker's view: the step's rows are the tables' rows stacked, each value's row among them
    step_rows = torch.cat(rows)
    base = [0, len(uniq[0]), 0]
    value_rows = np.concatenate([inv[f] + base[f] for f in range(3)])
    bounds = np.concatenate([[0], np.cumsum([len(v) for v in values])])
    pooled = torch.stack(
        [
            F.embedding_bag(torch.from_numpy(inv[f]), rows[(0, 1, 0)[f]], torch.from_numpy(offsets[f][:-1]), mode="sum")
            for f in range(3)
        ],
        dim=1,
    )
    mb = _MicroBatch(np.stack(offsets), bounds, b)
    want = FeaturePooling(feats).features_of(pooled, step_rows, mb, value_rows)
    for name in ("item", "genres"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    torch.testing.assert_close(got["history"].values, want["history"].values, rtol=0, atol=0)
    assert got["history"].lengths.tolist() == [0, 1, 3, 3, 2]
    # the longest bag keeps its last 3 values, oldest first
    last = inv[2][offsets[2][3] + 2 : offsets[2][4]]
    torch.testing.assert_close(got["history"].values[3], rows[0][torch.from_numpy(last)])


class _MicroBatch:
    """What features_of reads of a micro-batch: its bags, where each feature's values start, its size."""

    def __init__(self, offsets_flat, inverse_bounds, n):
        self.offsets_flat, self.inverse_bounds, self._n = offsets_flat, inverse_bounds, n

    def __len__(self):
        return self._n
