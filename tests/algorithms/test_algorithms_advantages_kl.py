"""Group advantages and KL estimators against loops and Schulman's Gaussian table."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    group_advantages,
    kl_estimate,
    token_advantages,
)


def loop_advantages(rewards: list[float], normalize_std: bool, eps: float, unbiased: bool):
    n = len(rewards)
    mean = sum(rewards) / n
    out = [r - mean for r in rewards]
    if not normalize_std:
        return out
    var = sum(c * c for c in out) / (max(n - 1, 1) if unbiased else n)
    return [c / (math.sqrt(var) + eps) for c in out]


@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_grouped_and_flat_advantages_match_loops(normalize_std, unbiased):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (5, 4), generator=g).double()
    rewards[1] = 1.0  # zero-variance group -> advantage 0
    rewards[2] = torch.tensor([0.3, -1.0, 2.5, 0.0])
    kw = {"normalize_std": normalize_std, "eps": 1e-6, "unbiased": unbiased}
    adv = group_advantages(rewards, **kw)
    for i, row in enumerate(rewards.tolist()):
        expected = loop_advantages(row, normalize_std, 1e-6, unbiased)
        assert adv[i].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert adv[1].abs().max() == 0

    # The same rewards flat, shuffled, with arbitrary non-contiguous group ids.
    ids = torch.arange(5).repeat_interleave(4) * 7 + 3
    perm = torch.randperm(20, generator=g)
    flat = group_advantages(rewards.flatten()[perm], ids[perm], **kw)
    torch.testing.assert_close(flat, adv.flatten()[perm], rtol=1e-12, atol=1e-12)


def test_flat_groups_of_different_sizes_and_a_singleton():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 7.0])
    ids = torch.tensor([10, 10, 10, 20, 20, 30])
    adv = group_advantages(rewards, ids)
    expected = loop_advantages([1.0, 0.0, 0.5], True, 1e-6, True)
    expected += loop_advantages([2.0, 4.0], True, 1e-6, True) + [0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(group_advantages(torch.tensor([[3.0]])), torch.zeros(1, 1))


def test_estimator_registry_and_token_broadcast():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS["group_mean"](rewards), rewards - 0.5)
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS["group_mean_std"](rewards),
        (rewards - 0.5) / (math.sqrt(1 / 3) + 1e-6),
    )
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    out = token_advantages(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.5]]


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("group_ids", lambda: group_advantages(torch.ones(4))),
        ("group_ids", lambda: group_advantages(torch.ones(2, 2), torch.zeros(2))),
        ("group_ids", lambda: group_advantages(torch.ones(4), torch.zeros(3, dtype=torch.long))),
        ("group_ids", lambda: group_advantages(torch.ones(4), torch.zeros(4))),
        ("rewards", lambda: group_advantages(torch.ones(2, 2, 2))),
        ("rewards", lambda: group_advantages(torch.tensor([[1.0, float("nan")]]))),
        ("eps", lambda: group_advantages(torch.ones(2, 2), eps=-1.0)),
        ("advantages", lambda: token_advantages(torch.ones(3), torch.ones(2, 4))),
    ],
)
def test_advantage_bad_input(argument, call):
    with pytest.raises(ValueError, match=argument):
        call()


def test_k1_k3_unbiased_and_k3_lower_variance_on_gaussians():
    """Schulman's table: q = N(0, 1) samples, p = N(1, 1), KL(q || p) = 0.5; std/true is 2.0
    for k1 and about 1.7 for k3; k2 is biased by +25%."""
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logq = -0.5 * x**2  # the normalizers cancel in log p - log q
    logp = -0.5 * (x - 1.0) ** 2
    true_kl = 0.5
    stats = {}
    for name in ("k1", "k2", "k3", "low_var_kl"):
        k = kl_estimate(logq, logp, name)
        stats[name] = (k.mean().item() / true_kl, k.std().item() / true_kl)
    assert stats["k1"][0] == pytest.approx(1.0, abs=0.01)
    assert stats["k3"][0] == pytest.approx(1.0, abs=0.01)
    assert stats["k2"][0] == pytest.approx(1.25, abs=0.01)
    assert stats["k1"][1] == pytest.approx(2.0, abs=0.01)
    assert stats["k3"][1] == pytest.approx(1.7, abs=0.05)
    assert stats["k3"][1] < stats["k1"][1]
    # low_var_kl clamps k3 at 10: the tail (x > ~3.6) loses a little mean and much variance.
    assert stats["low_var_kl"][0] == pytest.approx(1.0, abs=0.02)
    assert stats["low_var_kl"][1] < stats["k3"][1]


def test_kl_estimators_formulas_and_bounds():
    lp = torch.tensor([-1.0, -2.0, -0.1, -30.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.5, -3.0, -1.0], dtype=torch.float64)
    log_r = (ref - lp).detach()
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), -log_r)
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), 0.5 * log_r**2)
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), log_r.exp() - 1 - log_r)
    k3 = kl_estimate(lp, ref, "k3")
    assert (k3 >= 0).all() and k3[0] == 0
    low = kl_estimate(lp, ref, "low_var_kl")
    assert low[3] == 10.0 and torch.equal(low[:3], k3[:3])
    (grad,) = torch.autograd.grad(low.sum(), lp)
    assert grad[3] == 0 and torch.isfinite(grad).all()
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3", "low_var_kl"]
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(lp, ref, "k5")
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_estimate(lp, ref[:2], "k3")
