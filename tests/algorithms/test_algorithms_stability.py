"""The stability telemetry and guardrails of gspo_megatron.algorithms against float64 loops: the
rollout/trainer k3 KL and the tokens past a threshold on a fixed batch, the clip fraction split
by version lag and response length, non-finite totals kept visible, and the clip-scale table of
every policy loss."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms import (
    POLICY_LOSSES,
    clip_buckets,
    finalize_metrics,
    policy_loss,
    rollout_mismatch_sums,
)
from gspo_megatron.algorithms.losses import CLIP_SCALE_BOUNDARY, clip_scale_problem

F64 = torch.float64

# A fixed batch: 3 responses of 4, 2 and 3 tokens (log-probs of the sampled tokens).
ROLLOUT = [[-0.5, -1.2, -0.05, -2.0], [-0.7, -0.3], [-1.0, -0.01, -3.0]]
TRAINER = [[-0.45, -1.6, -0.05, -2.3], [-0.7, -0.31], [-0.2, -0.02, -3.05]]


def padded(rows):
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width, dtype=F64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.tensor(r, dtype=F64)
        mask[i, : len(r)] = True
    return values, mask


def test_rollout_mismatch_matches_a_float64_loop():
    rollout, mask = padded(ROLLOUT)
    trainer, _ = padded(TRAINER)
    got = finalize_metrics(rollout_mismatch_sums(rollout, trainer, mask, threshold=0.2))
    k3, past, diffs = [], 0, []
    for rows_r, rows_t in zip(ROLLOUT, TRAINER, strict=True):
        for r, t in zip(rows_r, rows_t, strict=True):
            log_ratio = t - r  # log pi_trainer / pi_rollout, on the rollout's samples
            k3.append(math.exp(log_ratio) - 1 - log_ratio)
            past += abs(log_ratio) > 0.2
            diffs.append(abs(log_ratio))
    assert got["k3_kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-12)
    assert got["tokens_past_threshold"] == past / len(k3) == 3 / 9
    assert got["logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-12)
    assert got["logprob_abs_diff_max"] == pytest.approx(0.8)
    # Identical engines: nothing to report but zeros.
    same = finalize_metrics(rollout_mismatch_sums(rollout, rollout, mask, threshold=0.2))
    assert same == {k: 0.0 for k in got}


def test_rollout_mismatch_ignores_padding_and_refuses_bad_input():
    rollout, mask = padded(ROLLOUT)
    trainer, _ = padded(TRAINER)
    junk = trainer.clone()
    junk[~mask] = float("nan")
    a = rollout_mismatch_sums(rollout, trainer, mask, 0.2)
    b = rollout_mismatch_sums(rollout, junk, mask, 0.2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="threshold"):
        rollout_mismatch_sums(rollout, trainer, mask, 0.0)
    with pytest.raises(ValueError, match="trainer_logprobs"):
        rollout_mismatch_sums(rollout, trainer[:, :2], mask, 0.2)


@pytest.mark.parametrize("loss", ["gspo", "grpo", "dapo", "gmpo", "cispo"])
def test_clip_fraction_by_lag_and_length_matches_a_loop(loss):
    g = torch.Generator().manual_seed(3)
    B, T = 8, 6
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=F64)
    new = old + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    if POLICY_LOSSES[loss].clip_scale == "sequence":
        new = old + 1e-3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    lags = torch.randint(0, 4, (B, T), generator=g)
    buckets = clip_buckets(lags, lengths, max_new_tokens=6)
    _, metrics = policy_loss(loss, new, old, adv, mask, token_buckets=buckets)
    _, plain = policy_loss(loss, new, old, adv, mask)
    hp = POLICY_LOSSES[loss].resolve_hparams({})
    clipped = loop_clipped(loss, new, old, adv, mask, hp)
    for group, label_of in (
        ("lag", lambda i, t: ("0", "1", "2plus")[min(int(lags[i, t]), 2)]),
        # quarters of 6 tokens: 1 -> q1, 2-3 -> q2, 4 -> q3, 5-6 -> q4
        ("length", lambda i, t: ("q1", "q2", "q2", "q3", "q4", "q4")[int(lengths[i]) - 1]),
    ):
        counts: dict[str, list[int]] = {}
        for i in range(B):
            for t in range(int(lengths[i])):
                c = counts.setdefault(label_of(i, t), [0, 0])
                c[0] += clipped[i][t]
                c[1] += 1
        names = {k for k in metrics if k.startswith(f"clip_fraction_{group}_")}
        assert names == {f"clip_fraction_{group}_{label}" for label in counts}  # empty: left out
        for label, (n_clipped, n) in counts.items():
            assert metrics[f"clip_fraction_{group}_{label}"] == pytest.approx(n_clipped / n)
    assert plain["clip_fraction"] == metrics["clip_fraction"]
    assert not any(k.startswith("clip_fraction_") for k in plain)


def loop_clipped(loss, new, old, adv, mask, hp):
    """Per token: 1 where the loss's clip is active (a clipped sequence: all its tokens)."""
    B, T = new.shape
    out = []
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        a = float(adv[i])
        if loss == "gspo":
            s = math.exp(sum(float(new[i, t] - old[i, t]) for t in toks) / len(toks))
            hit = (a > 0 and s > 1 + hp["clip_high"]) or (a < 0 and s < 1 - hp["clip_low"])
            out.append([int(hit)] * T)
            continue
        row = []
        for t in range(T):
            lr = float(new[i, t] - old[i, t])
            r = math.exp(lr)
            if loss == "gmpo":
                hit = (a > 0 and lr > hp["clip_high"]) or (a < 0 and lr < -hp["clip_low"])
            elif loss == "cispo":
                hit = r > 1 + hp["clip_high"]
            else:
                hit = (a > 0 and r > 1 + hp["clip_high"]) or (a < 0 and r < 1 - hp["clip_low"])
            row.append(int(hit and bool(mask[i, t])))
        out.append(row)
    return out


def test_a_nan_total_is_reported_not_zeroed():
    t = torch.tensor
    got = finalize_metrics({"loss_sum/sum": t(float("nan")), "r/max": t(float("nan"))})
    assert math.isnan(got["loss_sum"]) and math.isnan(got["r"])
    empty = finalize_metrics(
        {"b/sum": t(0.0), "b/count": t(0.0), "c/sum": t(1.0), "c/count": t(0.0)},
        omit_empty=("b",),
    )
    assert empty == {"c": 0.0}


def test_every_loss_has_a_clip_scale_and_its_defaults_pass():
    """The table decides which scale applies: GMPO's ratio is sequence-level but its clip bounds
    token log-ratios; SAPO has no hard clip."""
    scales = {name: spec.clip_scale for name, spec in POLICY_LOSSES.items()}
    assert scales == {
        "gspo": "sequence", "gspo_token": "sequence", "ppo": "token", "grpo": "token",
        "dapo": "token", "dr_grpo": "token", "sapo": None, "cispo": "token", "gmpo": "token",
    }  # fmt: skip
    for name in POLICY_LOSSES:
        extra = {"max_response_length": 8} if name == "dr_grpo" else {}
        assert clip_scale_problem(name, extra) is None, name


@pytest.mark.parametrize(
    "loss, hparams, key, scale",
    [
        ("gspo", {"clip_low": 0.2, "clip_high": 0.2}, "clip_low", "token"),
        ("gspo", {"clip_high": CLIP_SCALE_BOUNDARY}, "clip_high", "token"),
        ("gspo_token", {"clip_high": 0.4}, "clip_high", "token"),
        ("grpo", {"clip_low": 3e-4, "clip_high": 4e-4}, "clip_low", "sequence"),
        ("gmpo", {"clip_high": 4e-4}, "clip_high", "sequence"),
        ("cispo", {"clip_high": 0.001}, "clip_high", "sequence"),
    ],
)
def test_a_clip_at_the_other_scale_is_named(loss, hparams, key, scale):
    got_key, why = clip_scale_problem(loss, hparams)
    assert got_key == key
    assert f"is a {scale}-scale clip" in why
    practice = "3e-4 / 4e-4" if scale == "token" else "0.2"
    assert practice in why
    assert clip_scale_problem("sapo", {"tau_pos": 3e-4}) is None
