"""PPO's critic side (token rewards, GAE, whitening, value loss, explained variance) against
float64 loops over plain lists."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gspo_megatron.algorithms import (
    ValueLossTerms,
    explained_variance,
    explained_variance_from_sums,
    finalize_metrics,
    gae,
    masked_whiten,
    merge_metric_sums,
    token_rewards,
    value_loss_terms,
)


def loop_gae(rewards: list[float], values: list[float], mask: list[bool], gamma, lam):
    """A_k = Σ_{j>=k} (gamma·lam)^(j-k) delta_j over the row's masked steps, written out."""
    steps = [t for t, on in enumerate(mask) if on]
    n = len(steps)
    value_after = [values[steps[k + 1]] if k + 1 < n else 0.0 for k in range(n)]
    deltas = [rewards[steps[k]] + gamma * value_after[k] - values[steps[k]] for k in range(n)]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    for k, t in enumerate(steps):
        adv[t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, n))
        ret[t] = adv[t] + values[t]
    return adv, ret


def loop_gae_batch(rewards, values, mask, gamma, lam):
    rows = [
        loop_gae(r, v, [m != 0 for m in mk], gamma, lam)
        for r, v, mk in zip(rewards.tolist(), values.tolist(), mask.tolist(), strict=True)
    ]
    adv = torch.tensor([a for a, _ in rows], dtype=torch.float64)
    ret = torch.tensor([r for _, r in rows], dtype=torch.float64)
    return adv, ret


def random_batch(seed: int, b: int = 7, t: int = 10):
    """Random rewards/values with NaN padding outside a mask that has holes, an empty row and
    rows whose only token is the first or the last position."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[0] = False
    mask[1] = False
    mask[1, 0] = True
    mask[2] = False
    mask[2, -1] = True
    rewards = torch.where(mask, rewards, float("nan"))
    values = torch.where(mask, values, float("inf"))
    return rewards, values, mask


GAMMA_LAM = [(1.0, 1.0), (0.95, 0.95), (0.99, 0.9), (0.0, 0.7), (0.9, 0.0), (1.0, 0.0), (0.0, 0.0)]


@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAM)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_loop(seed, gamma, lam):
    rewards, values, mask = random_batch(seed)
    adv, ret = gae(rewards, values, mask.double(), gamma, lam)
    exp_adv, exp_ret = loop_gae_batch(rewards, values, mask, gamma, lam)
    assert adv.dtype == ret.dtype == torch.float64
    torch.testing.assert_close(adv, exp_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, exp_ret, rtol=1e-12, atol=1e-12)
    assert adv[0].abs().max() == 0 and ret[0].abs().max() == 0
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_special_cases():
    rewards, values, mask = random_batch(3)
    r = torch.where(mask, rewards, 0.0)
    v = torch.where(mask, values, 0.0)
    # gamma = lam = 1: returns are the sums of future rewards, advantages returns - values.
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    future = r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(ret, torch.where(mask, future, 0.0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, ret - v, rtol=1e-12, atol=1e-12)
    # lam = 0: one-step TD error, with the next *masked* value (0 after the last).
    gamma = 0.9
    adv, ret = gae(rewards, values, mask, gamma, 0.0)
    for b, row in enumerate(mask.tolist()):
        steps = [t for t, on in enumerate(row) if on]
        for k, t in enumerate(steps):
            nxt = v[b, steps[k + 1]].item() if k + 1 < len(steps) else 0.0
            td = r[b, t].item() + gamma * nxt - v[b, t].item()
            assert adv[b, t].item() == pytest.approx(td, rel=1e-12, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(td + v[b, t].item(), rel=1e-12, abs=1e-12)


def test_gae_float32_detached_and_close_to_float64():
    rewards, values, mask = random_batch(4)
    r32 = rewards.float()
    v32 = values.float().requires_grad_()
    adv, ret = gae(r32, v32, mask, 0.95, 0.9)
    exp_adv, exp_ret = loop_gae_batch(rewards, values, mask, 0.95, 0.9)
    assert adv.dtype == ret.dtype == torch.float32
    assert not adv.requires_grad and not ret.requires_grad
    torch.testing.assert_close(adv.double(), exp_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), exp_ret, rtol=1e-5, atol=1e-5)
    adv16, _ = gae(r32.bfloat16(), v32.detach().bfloat16(), mask, 0.95, 0.9)
    assert adv16.dtype == torch.float32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_observation_tokens_do_not_change_model_token_advantages(seed):
    """Multi-turn: masked-out observations between turns (any rewards/values on them) are not
    steps, so the model tokens' advantages equal those of the compact trajectory."""
    g = torch.Generator().manual_seed(seed)
    b, t, extra = 4, 8, 6
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    compact_adv, compact_ret = gae(rewards, values, torch.ones(b, t), 0.97, 0.9)

    long_t = t + extra
    long_r = torch.randn(b, long_t, generator=g, dtype=torch.float64) * 100
    long_v = torch.randn(b, long_t, generator=g, dtype=torch.float64) * 100
    long_mask = torch.zeros(b, long_t)
    positions = []
    for i in range(b):
        pos = torch.randperm(long_t, generator=g)[:t].sort().values
        positions.append(pos)
        long_mask[i, pos] = 1.0
        long_r[i, pos] = rewards[i]
        long_v[i, pos] = values[i]
    adv, ret = gae(long_r, long_v, long_mask, 0.97, 0.9)
    for i, pos in enumerate(positions):
        torch.testing.assert_close(adv[i, pos], compact_adv[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret[i, pos], compact_ret[i], rtol=1e-12, atol=1e-12)
    assert (adv[long_mask == 0] == 0).all()


def loop_token_rewards(final, mask, kl, kl_coef):
    out = []
    for f, row, kl_row in zip(final, mask, kl, strict=True):
        steps = [t for t, on in enumerate(row) if on]
        r = [(-kl_coef * k if on else 0.0) for on, k in zip(row, kl_row, strict=True)]
        if steps:
            r[steps[-1]] += f
        out.append(r)
    return out


def test_token_rewards_match_loop():
    g = torch.Generator().manual_seed(0)
    b, t = 6, 9
    final = torch.randn(b, generator=g, dtype=torch.float64)
    kl = torch.rand(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.5
    mask[0] = False  # no token: the final reward is dropped
    mask[1] = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 0], dtype=torch.bool)  # last token at 6
    mask[2, -1] = True
    kl_padded = torch.where(mask, kl, float("nan"))
    out = token_rewards(final, mask.float(), kl_padded, kl_coef=0.1)
    expected = loop_token_rewards(final.tolist(), mask.tolist(), kl.tolist(), 0.1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    assert out[0].abs().max() == 0 and out[1, 6] == final[1] - 0.1 * kl[1, 6]

    no_kl = token_rewards(final.float(), mask)
    assert no_kl.dtype == torch.float32
    expected = loop_token_rewards(final.tolist(), mask.tolist(), [[0.0] * t] * b, 0.0)
    torch.testing.assert_close(no_kl, torch.tensor(expected, dtype=torch.float32))
    torch.testing.assert_close(token_rewards(final, mask, kl, kl_coef=0.0), no_kl.double())


def test_masked_whiten_against_numpy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3 + 2
    mask = torch.rand(5, 7, generator=g) < 0.7
    padded = torch.where(mask, x, float("nan"))
    on = x.numpy()[mask.numpy()]
    mean, var = on.mean(), on.var(ddof=1)

    out = masked_whiten(padded, mask.float())
    expected = (on - mean) / np.sqrt(var + 1e-8)
    np.testing.assert_allclose(out.numpy()[mask.numpy()], expected, rtol=1e-12, atol=1e-12)
    assert (out[~mask] == 0).all()
    assert out[mask].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert out[mask].std().item() == pytest.approx(1.0, abs=1e-8)

    kept = masked_whiten(padded, mask, shift_mean=False, eps=0.0)
    np.testing.assert_allclose(
        kept.numpy()[mask.numpy()], (on - mean) / np.sqrt(var) + mean, rtol=1e-12, atol=1e-12
    )
    assert kept[mask].mean().item() == pytest.approx(mean, rel=1e-12)

    one = torch.zeros(2, 3, dtype=torch.bool)
    one[1, 2] = True
    small = torch.where(one, x[:2, :3], float("nan"))
    assert masked_whiten(small, one).abs().max() == 0  # one entry: var 0
    kept_one = masked_whiten(small, one, shift_mean=False)
    assert kept_one[1, 2] == x[1, 2] and kept_one.count_nonzero() == 1
    assert masked_whiten(padded, torch.zeros(5, 7)).abs().max() == 0
    assert masked_whiten(x.float().requires_grad_(), mask).dtype == torch.float32


def loop_value_loss(v, old, ret, mask, clip):
    """Per-token losses, clip flags and d(loss)/dv, element by element."""
    losses, flags, grads = [], [], []
    for vi, oi, ri, on in zip(v, old, ret, mask, strict=True):
        if not on:
            losses.append(0.0)
            flags.append(False)
            grads.append(0.0)
            continue
        plain = (vi - ri) ** 2
        if clip:
            v_clip = oi + min(max(vi - oi, -clip), clip)
            clipped = (v_clip - ri) ** 2
        else:
            clipped = -1.0
        flags.append(clipped > plain)
        losses.append(0.5 * max(plain, clipped))
        # The clipped term only wins when v is outside [old - clip, old + clip], where
        # v_clip no longer depends on v.
        grads.append(0.0 if clipped > plain else vi - ri)
    return losses, flags, grads


@pytest.mark.parametrize("clip", [None, 0.0, 0.2])
def test_value_loss_matches_loop_with_gradient(clip):
    g = torch.Generator().manual_seed(1)
    b, t = 5, 8
    old = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = (old + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_()
    ret = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0] = False
    nan = float("nan")
    terms = value_loss_terms(
        torch.where(mask, values, nan),
        torch.where(mask, old, nan),
        torch.where(mask, ret, nan),
        mask.float(),
        clip=clip,
    )
    assert isinstance(terms, ValueLossTerms)
    losses, flags, grads = loop_value_loss(
        values.flatten().tolist(), old.flatten().tolist(), ret.flatten().tolist(),
        mask.flatten().tolist(), clip,
    )  # fmt: skip
    assert terms.loss_sum.item() == pytest.approx(math.fsum(losses), rel=1e-12)
    (grad,) = torch.autograd.grad(terms.loss_sum, values)
    torch.testing.assert_close(grad.flatten(), torch.tensor(grads, dtype=torch.float64))
    if clip:
        assert 0 < sum(flags) < mask.sum()  # the case exercises both branches

    n = int(mask.sum())
    metrics = finalize_metrics(terms.metric_sums)
    assert all(not x.requires_grad for x in terms.metric_sums.values())
    assert metrics["value_loss"] == pytest.approx(math.fsum(losses) / n, rel=1e-12)
    assert metrics["value_clip_fraction"] == pytest.approx(sum(flags) / n, rel=1e-12)
    assert metrics["values"] == pytest.approx(values[mask].mean().item(), rel=1e-12)
    assert metrics["returns"] == pytest.approx(ret[mask].mean().item(), rel=1e-12)


def test_value_clip_fraction_on_hand_made_tokens():
    # clip 0.2 around old; R the target. Columns:
    # 0: v=0.5 old=0 R=1 -> v_clip=0.2, (0.8)^2 > (0.5)^2: clipping binds, gradient cut.
    # 1: v=-0.5 old=0 R=1 -> v_clip=-0.2, (1.2)^2 < (1.5)^2: moved away from R, not clipped.
    # 2: v=0.1 old=0 R=1 -> inside the range, v_clip = v: not clipped.
    # 3: v=1.5 old=1 R=2 -> v_clip=1.2, (0.8)^2 > (0.5)^2: binds.
    # 4: padding (mask 0), binding values that must not count.
    values = torch.tensor([[0.5, -0.5, 0.1, 1.5, 0.5]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    ret = torch.tensor([[1.0, 1.0, 1.0, 2.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    terms = value_loss_terms(values, old, ret, mask, clip=0.2)
    metrics = finalize_metrics(terms.metric_sums)
    assert metrics["value_clip_fraction"] == pytest.approx(2 / 4)
    expected = 0.5 * (0.8**2 + 1.5**2 + 0.9**2 + 0.8**2)
    assert terms.loss_sum.item() == pytest.approx(expected, rel=1e-6)
    (grad,) = torch.autograd.grad(terms.loss_sum, values)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.5, -0.9, 0.0, 0.0]]))
    # Unclipped: nothing binds.
    plain = value_loss_terms(values, old, ret, mask, clip=None)
    assert finalize_metrics(plain.metric_sums)["value_clip_fraction"] == 0.0
    assert plain.loss_sum.dtype == torch.float32


def test_explained_variance_from_sums_equals_direct_across_micro_batches():
    g = torch.Generator().manual_seed(2)
    b, t = 6, 10
    ret = torch.randn(b, t, generator=g, dtype=torch.float64) * 2 + 5
    values = ret + 0.7 * torch.randn(b, t, generator=g, dtype=torch.float64)
    old = values.clone()
    mask = torch.rand(b, t, generator=g) < 0.6
    on_r, on_v = ret[mask].numpy(), values[mask].numpy()
    reference = 1.0 - np.var(on_r - on_v) / np.var(on_r)

    direct = explained_variance(values, ret, mask)
    assert direct == pytest.approx(reference, rel=1e-12)
    parts = [
        value_loss_terms(values[s], old[s], ret[s], mask[s], clip=0.2).metric_sums
        for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    ]
    totals = finalize_metrics(merge_metric_sums(parts))
    assert explained_variance_from_sums(totals) == pytest.approx(direct, rel=1e-10)
    assert totals["ev_residual_sq"] == pytest.approx(np.mean((on_r - on_v) ** 2), rel=1e-12)

    # A perfect critic explains everything; constant returns or no token give 0.0.
    perfect = value_loss_terms(ret, old, ret, mask, clip=0.2).metric_sums
    assert explained_variance_from_sums(finalize_metrics(perfect)) == 1.0
    assert explained_variance(ret, ret, mask) == 1.0
    flat = torch.full((b, t), 0.1, dtype=torch.float64)
    flat_sums = value_loss_terms(values, old, flat, mask, clip=None).metric_sums
    assert explained_variance_from_sums(finalize_metrics(flat_sums)) == 0.0
    assert explained_variance(values, flat, mask) == 0.0
    none = value_loss_terms(values, old, ret, torch.zeros(b, t), clip=None)
    assert none.loss_sum.item() == 0.0
    assert explained_variance_from_sums(finalize_metrics(none.metric_sums)) == 0.0
    assert explained_variance(values, ret, torch.zeros(b, t)) == 0.0


BT = torch.zeros(2, 3)
MASK = torch.ones(2, 3)


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("final_rewards", lambda: token_rewards(torch.zeros(3), MASK)),
        ("final_rewards", lambda: token_rewards(torch.tensor([0.0, math.inf]), MASK)),
        ("mask", lambda: token_rewards(torch.zeros(2), torch.ones(2, 3, 1))),
        ("kl", lambda: token_rewards(torch.zeros(2), MASK, kl_coef=0.1)),
        ("kl", lambda: token_rewards(torch.zeros(2), MASK, torch.zeros(2, 4), kl_coef=0.1)),
        ("kl", lambda: token_rewards(torch.zeros(2), MASK, BT + math.nan, kl_coef=0.1)),
        ("kl_coef", lambda: token_rewards(torch.zeros(2), MASK, BT, kl_coef=-0.1)),
        ("rewards", lambda: gae(torch.zeros(2, 4), BT, MASK, 1.0, 1.0)),
        ("rewards", lambda: gae(BT + math.nan, BT, MASK, 1.0, 1.0)),
        ("values", lambda: gae(BT, torch.zeros(3, 3), MASK, 1.0, 1.0)),
        ("values", lambda: gae(BT, BT - math.inf, MASK, 1.0, 1.0)),
        ("mask", lambda: gae(BT, BT, "mask", 1.0, 1.0)),
        ("gamma", lambda: gae(BT, BT, MASK, 1.1, 1.0)),
        ("gamma", lambda: gae(BT, BT, MASK, -0.1, 1.0)),
        ("lam", lambda: gae(BT, BT, MASK, 1.0, 2.0)),
        ("lam", lambda: gae(BT, BT, MASK, 1.0, math.nan)),
        ("values", lambda: masked_whiten(torch.zeros(2, 4), MASK)),
        ("values", lambda: masked_whiten(BT + math.nan, MASK)),
        ("eps", lambda: masked_whiten(BT, MASK, eps=-1e-8)),
        ("values", lambda: value_loss_terms(BT.long(), BT, BT, MASK, clip=0.2)),
        ("values", lambda: value_loss_terms(BT + math.nan, BT, BT, MASK, clip=0.2)),
        ("old_values", lambda: value_loss_terms(BT, torch.zeros(2), BT, MASK, clip=0.2)),
        ("old_values", lambda: value_loss_terms(BT, BT + math.inf, BT, MASK, clip=0.2)),
        ("returns", lambda: value_loss_terms(BT, BT, torch.zeros(2, 4), MASK, clip=0.2)),
        ("returns", lambda: value_loss_terms(BT, BT, BT + math.nan, MASK, clip=0.2)),
        ("clip", lambda: value_loss_terms(BT, BT, BT, MASK, clip=-0.2)),
        ("mask", lambda: value_loss_terms(BT, BT, BT, torch.ones(6), clip=0.2)),
        ("returns", lambda: explained_variance(BT, torch.zeros(2, 4), MASK)),
        ("values", lambda: explained_variance(BT + math.nan, BT, MASK)),
    ],
)
def test_gae_bad_input(argument, call):
    with pytest.raises(ValueError, match=argument):
        call()
