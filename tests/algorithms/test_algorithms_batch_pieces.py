"""Mismatch corrections, DAPO/DUPO batch pieces, metric conventions, and the import boundary."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from gspo_megatron.algorithms import (
    correct_mismatch,
    dapo_keep_indices,
    dupo_fill_indices,
    finalize_metrics,
    informative_groups,
    merge_metric_sums,
    metric_reduce_op,
    overlong_filter_mask,
    policy_loss,
    prefilter_solved_prompts,
    rollout_metrics,
    soft_overlong_penalty,
)

F64 = torch.float64


def mismatch_batch(seed=0, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g, dtype=F64) * 2
    old = rollout + 0.6 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = False
    return rollout, old, mask


def loop_weight(rollout, old, mask, i, t, mode, level, cap, lower, upper):
    toks = [u for u in range(mask.shape[1]) if mask[i, u]]
    if level == "token":
        log_w = old[i, t].item() - rollout[i, t].item()
    else:
        log_w = sum(old[i, u].item() - rollout[i, u].item() for u in toks)
        if level == "geometric":
            log_w /= len(toks)
    w = math.exp(log_w)
    if mode == "tis":
        return min(w, cap)
    return w if lower <= w <= upper else 0.0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_mismatch_weights_match_loops(mode, level):
    rollout, old, mask = mismatch_batch()
    kw = {"mode": mode, "level": level, "cap": 1.15, "lower": 0.8, "upper": 1.25}
    out = correct_mismatch(rollout, mask, old_logprobs=old, **kw)
    assert out.old_logprobs is old
    w = out.is_weights
    n_corrected = 0
    for i in range(mask.shape[0]):
        if not mask[i].any():
            continue
        for t in range(mask.shape[1]):
            if level == "token" and not mask[i, t]:
                assert w[i, t] == 0
                continue
            expected = loop_weight(rollout, old, mask, i, t, mode, level, 1.15, 0.8, 1.25)
            got = w[i, t] if level == "token" else w[i]
            assert got.item() == pytest.approx(expected, rel=1e-12)
            raw = loop_weight(rollout, old, mask, i, t, "mis", level, 0, 0.0, math.inf)
            n_corrected += int(expected != raw)
            if level != "token":
                break
    assert w.shape == (mask.shape if level == "token" else mask.shape[:1])
    metrics = finalize_metrics(out.metric_sums)
    items = mask.sum().item() if level == "token" else mask.any(-1).sum().item()
    assert metrics["mismatch_corrected_fraction"] == pytest.approx(n_corrected / items)
    assert 0 < n_corrected < items  # both branches exercised


def test_rollout_logprobs_as_old_policy_and_no_correction():
    rollout, old, mask = mismatch_batch(1)
    out = correct_mismatch(rollout, mask)
    assert out.old_logprobs is rollout and out.is_weights is None
    out = correct_mismatch(rollout, mask, old_logprobs=old, mode="none")
    assert out.old_logprobs is old and out.is_weights is None
    kls = [
        math.expm1(old[i, t].item() - rollout[i, t].item()) - (old[i, t] - rollout[i, t]).item()
        for i, t in mask.nonzero().tolist()
    ]
    mismatch_kl = finalize_metrics(out.metric_sums)["mismatch_kl"]
    assert mismatch_kl == pytest.approx(sum(kls) / len(kls), rel=1e-12)
    with pytest.raises(ValueError, match="old_logprobs"):
        correct_mismatch(rollout, mask, mode="tis")


def test_sequence_weights_under_a_context_parallel_split():
    rollout, old, mask = mismatch_batch(2, T=8)
    captured = {}

    def capture(x):
        captured["sums"] = x.clone()
        return x

    full = correct_mismatch(rollout, mask, old_logprobs=old, mode="tis", level="geometric",
                            seq_sum=capture)  # fmt: skip
    for cols in (slice(0, 3), slice(3, 8)):  # each rank sees the reduced sums of whole rows
        half = correct_mismatch(
            rollout[:, cols], mask[:, cols], old_logprobs=old[:, cols], mode="tis",
            level="geometric", seq_sum=lambda x: captured["sums"],
        )  # fmt: skip
        torch.testing.assert_close(half.is_weights, full.is_weights)


def test_weights_flow_into_the_losses():
    rollout, old, mask = mismatch_batch(3)
    lp = (old + 0.1).requires_grad_()
    adv = torch.linspace(-1, 1, 6, dtype=F64)
    seq = correct_mismatch(rollout, mask, old_logprobs=old, mode="tis", level="geometric")
    tok = correct_mismatch(rollout, mask, old_logprobs=old, mode="mis", level="token")
    loss_w, _ = policy_loss("gspo", lp, seq.old_logprobs, adv, mask, is_weights=seq.is_weights)
    loss, _ = policy_loss("gspo", lp, old, adv, mask)
    assert loss_w.item() != loss.item()
    loss_t, _ = policy_loss("dapo", lp, tok.old_logprobs, adv, mask, is_weights=tok.is_weights)
    assert torch.isfinite(loss_t)


@pytest.mark.parametrize(
    ("argument", "kwargs"),
    [
        ("mode", {"mode": "clip"}),
        ("level", {"level": "batch"}),
        ("cap", {"mode": "tis", "cap": 0.0}),
        ("lower", {"mode": "mis", "lower": -0.1}),
        ("upper", {"mode": "mis", "lower": 2.0, "upper": 1.0}),
        ("old_logprobs", {"old_logprobs": torch.zeros(2, 2)}),
    ],
)
def test_mismatch_bad_input(argument, kwargs):
    rollout, old, mask = mismatch_batch(4)
    kwargs = {"old_logprobs": old} | kwargs
    with pytest.raises(ValueError, match=argument):
        correct_mismatch(rollout, mask, **kwargs)


# ---------------------------------------------------------------------------------------------
# DAPO / DUPO


REWARDS = torch.tensor(
    [
        [1.0, 1.0, 1.0, 1.0],  # solved by all: zero variance
        [0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],  # zero variance
        [0.5, 1.0, 1.0, 1.0],
        [0.2, 0.2, 0.2, 0.2],  # zero variance
    ]
)


def test_dynamic_sampling_filters():
    assert informative_groups(REWARDS).tolist() == [False, True, False, True, False]
    assert dapo_keep_indices(REWARDS).tolist() == [1, 3]
    assert dapo_keep_indices(REWARDS, max_groups=1).tolist() == [1]
    assert informative_groups(REWARDS, atol=0.6).tolist() == [False, True, False, False, False]
    assert prefilter_solved_prompts(REWARDS).tolist() == [False, True, True, True, True]
    assert prefilter_solved_prompts(REWARDS, solved_reward=0.2).tolist() == [
        False, True, True, False, False,
    ]  # fmt: skip


def test_dupo_fills_every_slot_with_informative_groups():
    for seed in range(5):
        idx = dupo_fill_indices(REWARDS, generator=torch.Generator().manual_seed(seed))
        assert idx.numel() == 5 and idx[:2].tolist() == [1, 3]
        assert set(idx[2:].tolist()) <= {1, 3}
        counts = torch.bincount(idx, minlength=5)
        assert counts.max() - counts[counts > 0].min() <= 1  # duplicates spread evenly
    big = dupo_fill_indices(REWARDS, num_groups=11, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(big, minlength=5)
    assert big.numel() == 11 and sorted(counts.tolist()) == [0, 0, 0, 5, 6]
    a = dupo_fill_indices(REWARDS, generator=torch.Generator().manual_seed(3))
    b = dupo_fill_indices(REWARDS, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert dupo_fill_indices(REWARDS[[0, 2, 4]]).numel() == 0  # nothing informative
    assert dupo_fill_indices(REWARDS, num_groups=1).tolist() == [1]


def test_overlong_filtering_and_soft_punishment():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    lengths = torch.tensor([0, 15, 16, 18, 20, 21, 100])
    penalty = soft_overlong_penalty(lengths, max_response_length=20, cache_length=5)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty(lengths, max_response_length=20, cache_length=30)
    with pytest.raises(ValueError, match="max_response_length"):
        soft_overlong_penalty(lengths, max_response_length=0, cache_length=5)
    with pytest.raises(ValueError, match="truncated"):
        overlong_filter_mask(mask, torch.tensor([True]))
    with pytest.raises(ValueError, match="rewards"):
        informative_groups(torch.ones(4))


# ---------------------------------------------------------------------------------------------
# Metric conventions


def test_metric_reduction_and_finalize():
    assert [metric_reduce_op(k) for k in ("a/sum", "a/count", "b/max", "c/min")] == [
        "sum", "sum", "max", "min",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="metric key"):
        metric_reduce_op("loss")
    t = torch.tensor
    merged = merge_metric_sums(
        [
            {
                "x/sum": t(2.0),
                "x/count": t(4.0),
                "r/max": t(1.5),
                "r2/min": t(0.5),
                "n/sum": t(3.0),
            },
            {
                "x/sum": t(1.0),
                "x/count": t(2.0),
                "r/max": t(2.5),
                "r2/min": t(0.7),
                "n/sum": t(1.0),
            },
        ]
    )
    assert finalize_metrics(merged) == {"x": 0.5, "r": 2.5, "r2": 0.5, "n": 4.0}
    empty = {"x/sum": t(0.0), "x/count": t(0.0), "r/max": t(-math.inf), "r2/min": t(math.inf)}
    assert finalize_metrics(empty) == {"x": 0.0, "r": 0.0, "r2": 0.0}


def test_rollout_metrics():
    metrics = rollout_metrics(
        REWARDS, response_lengths=torch.arange(20), truncated=torch.arange(20) % 4 == 0
    )
    assert metrics["reward/mean"] == pytest.approx(REWARDS.mean().item())
    assert metrics["reward/std"] == pytest.approx(REWARDS.double().std().item())
    assert metrics["sampling/groups_generated"] == REWARDS.shape[0]
    assert metrics["sampling/groups_zero_variance"] == 0.6 * REWARDS.shape[0]
    assert metrics["reward/solved_all_fraction"] == pytest.approx(0.2)
    assert metrics["reward/solved_none_fraction"] == pytest.approx(0.4)
    assert metrics["response/length_max"] == 19 and metrics["response/tokens"] == 190
    assert metrics["response/truncated_fraction"] == 0.25
    with pytest.raises(ValueError, match="response_lengths"):
        rollout_metrics(REWARDS, response_lengths=torch.arange(3))


def test_algorithms_package_imports_no_megatron():
    code = (
        "import sys, gspo_megatron.algorithms\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'megatron'"
        " or m.startswith('gspo_megatron.megatron')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
