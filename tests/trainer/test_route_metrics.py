"""The route metrics the old-policy forward feeds (moe/route_flips, moe/max_expert_load_over_mean)
against plain per-token references."""

from __future__ import annotations

import numpy as np
import pytest

from gspo_megatron.step_inputs import _expert_load, _route_flips


def _reference_flips(rollout, trainer):
    """Per token and layer: do the two expert multisets differ? (Python sorted lists)"""
    layers = trainer[0].shape[1]
    changed, tokens = [0] * layers, 0
    for a, b in zip(rollout, trainer, strict=True):
        n = min(len(a), len(b))
        a, b = np.asarray(a[:n]).reshape(n, layers, -1), np.asarray(b[:n]).reshape(n, layers, -1)
        tokens += n
        for t in range(n):
            for layer in range(layers):
                changed[layer] += sorted(a[t, layer].tolist()) != sorted(b[t, layer].tolist())
    out = {"moe/route_flips": sum(changed) / (tokens * layers)}
    out |= {f"moe/route_flips/layer_{i}": c / tokens for i, c in enumerate(changed)}
    return out


@pytest.mark.parametrize("topk", [1, 2, 3])
@pytest.mark.parametrize("ragged", [False, True])
def test_route_flips_equal_a_per_token_set_comparison(topk, ragged):
    """Same lengths (one concatenation) or not (cut to the shorter), pairs (min / max) or not
    (np.sort), duplicates and swapped orders included."""
    rng = np.random.default_rng(topk + 10 * ragged)
    lengths = rng.integers(1, 12, 50)
    rollout = [rng.integers(0, 4, (n, 3, topk)).astype(np.int32) for n in lengths]
    trainer = []
    for r in rollout:
        t = r[:, :, ::-1].astype(np.int16)  # the same sets in another order
        t[rng.random(t.shape[:2]) < 0.3, 0] = rng.integers(0, 4)  # some tokens' first expert
        trainer.append(np.ascontiguousarray(t[: max(1, len(t) - 1)] if ragged else t))
    got = _route_flips(rollout, trainer)
    assert got == pytest.approx(_reference_flips(rollout, trainer), rel=0, abs=0)
    assert 0 < got["moe/route_flips"] < 1


def test_expert_load_is_the_busiest_experts_share_over_the_mean():
    routes = [np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]]]), np.array([[[0, 3], [1, 3]]])]
    # layer 0: expert 0 three times of 6 (mean 1.5 over 4 experts): 2.0; layer 1: 3 of 6: 2.0
    assert _expert_load(routes, 4) == {"moe/max_expert_load_over_mean": 2.0}
    # top-1 routes as [tokens, layers]: the same as [tokens, layers, 1]
    top1 = [np.array([[0, 1], [0, 2]]), np.array([[1, 1]])]
    assert _expert_load(top1, 4) == {"moe/max_expert_load_over_mean": 2 / 0.75}
    assert _expert_load([r[..., None] for r in top1], 4) == _expert_load(top1, 4)
