"""Train/rollout mismatch: importance weights from rollout-engine log-probs, or rollout log-probs
used directly as pi_old.

The rollout engine samples from pi_rollout, which differs numerically from the training
engine's pi_old (kernels, precision, MoE routing). With w = pi_old / pi_rollout:

- ``tis`` (truncated importance sampling): weight min(w, cap).
- ``mis`` (masked importance sampling): weight w where lower <= w <= upper, else 0 (the item
  is dropped from the policy term; denominators are unchanged, so they stay known before the
  forward pass — to drop the tokens from the denominator too, pass
  ``response_mask & (weights > 0)`` to the loss instead).
- ``none``: no weights.

Levels: ``token`` (w per token, [B, T]), ``sequence`` (w_i = exp Σ_t log w_it, the sequence's
likelihood ratio, [B]) and ``geometric`` (w_i = exp mean_t log w_it, GSPO's length-normalized
ratio, [B]). Log-weights are clamped to [-20, 20] before exp, as the losses clamp log-ratios.
Pass the weights to the loss as ``is_weights``; sequence-level losses take [B] weights only.

Using rollout log-probs as pi_old (``old_logprobs=None``) skips the old-policy forward pass; the
GSPO paper notes that sequence-level ratios tolerate the engine's precision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from ._checks import (
    nonfinite_on,
    raise_if_flagged,
    require_number,
    require_shape,
    require_tensor,
    shape,
)
from .losses import LOG_RATIO_CLAMP, SeqSum

Level = Literal["token", "sequence", "geometric"]
LEVELS = ("token", "sequence", "geometric")


@dataclass
class MismatchCorrection:
    """What the loss needs: pi_old log-probs, optional weights, and metric sums.

    Attributes:
        old_logprobs: [B, T] log-probs to use as pi_old.
        is_weights: None, [B, T] (token level) or [B] (sequence/geometric level), detached.
        metric_sums: ``mismatch_*`` keys in the convention of ``metrics.py``.
    """

    old_logprobs: Tensor
    is_weights: Tensor | None
    metric_sums: dict[str, Tensor] = field(default_factory=dict)


def _truncate(w: Tensor, cap: float, lower: float, upper: float) -> tuple[Tensor, Tensor]:
    return w.clamp(max=cap), w > cap


def _mask(w: Tensor, cap: float, lower: float, upper: float) -> tuple[Tensor, Tensor]:
    outside = (w < lower) | (w > upper)
    return torch.where(outside, 0.0, w), outside


MISMATCH_MODES: Mapping[str, Callable[[Tensor, float, float, float], tuple[Tensor, Tensor]]]
MISMATCH_MODES = MappingProxyType({"tis": _truncate, "mis": _mask})
"""Mode name -> fn(weights, cap, lower, upper) -> (corrected weights, corrected flags).
``"none"`` (no weights) is accepted by :func:`correct_mismatch` too."""


def mismatch_support(loss: str, mode: str, level: str) -> str | None:
    """Why a loss cannot take mismatch weights of `level`, or None when it can.

    Sequence-ratio losses (``gspo``, ``gmpo``) compute one term per sequence, so they take one
    weight per sequence; a token-level weight has no term to multiply there. Token-level
    losses take either: token weights per token, a sequence weight on every token.
    """
    from .losses import get_policy_loss

    if mode == "none" or level != "token":
        return None
    if get_policy_loss(loss).aggregation == "sequence":
        return (
            "a sequence-ratio loss has one term per sequence and takes one importance weight "
            "per sequence; use mismatch_level=sequence (the sequence's likelihood ratio) or "
            "geometric (its per-token geometric mean, GSPO's own normalisation)"
        )
    return None


@torch.no_grad()
def correct_mismatch(
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    mode: str = "none",
    level: Level = "token",
    cap: float = 2.0,
    lower: float = 0.5,
    upper: float = 2.0,
    seq_sum: SeqSum | None = None,
    seq_share: Tensor | None = None,
) -> MismatchCorrection:
    """Choose pi_old and compute mismatch weights for one micro-batch.

    Args:
        rollout_logprobs: [B, T] log-probs the rollout engine reported for the sampled tokens.
        response_mask: [B, T] bool or 0/1.
        old_logprobs: [B, T] log-probs recomputed by the training engine, or None to use
            ``rollout_logprobs`` as pi_old (then ``mode`` must be ``"none"``).
        mode: ``"none"``, or a key of :data:`MISMATCH_MODES` (``"tis"``, ``"mis"``).
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        cap: TIS cap C (> 0).
        lower, upper: MIS keeps weights in [lower, upper] (0 <= lower < upper).
        seq_sum, seq_share: as in ``policy_loss_terms`` (sequence levels under CP).
    """
    rollout_logprobs = require_tensor("rollout_logprobs", rollout_logprobs, floating=True)
    if rollout_logprobs.dim() != 2:
        raise ValueError(f"rollout_logprobs must be [B, T], got {shape(rollout_logprobs)}")
    bt = shape(rollout_logprobs)
    response_mask = require_tensor("response_mask", response_mask)
    require_shape("response_mask", response_mask, bt, "the shape of rollout_logprobs")
    if mode != "none" and mode not in MISMATCH_MODES:
        raise ValueError(f"mode must be one of {['none', *MISMATCH_MODES]}, got {mode!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}, got {level!r}")
    cap = require_number("cap", cap, minimum=0.0, strict=True)
    lower = require_number("lower", lower, minimum=0.0)
    upper = require_number("upper", upper, minimum=lower, strict=True)
    mask = response_mask != 0
    if old_logprobs is None:
        if mode != "none":
            raise ValueError(
                f"old_logprobs is required for mode {mode!r}: with rollout log-probs as pi_old "
                "there is no mismatch to correct"
            )
        return MismatchCorrection(old_logprobs=rollout_logprobs, is_weights=None)
    old_logprobs = require_tensor("old_logprobs", old_logprobs, floating=True)
    require_shape("old_logprobs", old_logprobs, bt, "the shape of rollout_logprobs")
    raise_if_flagged(
        {
            "rollout_logprobs must be finite on response tokens": nonfinite_on(
                rollout_logprobs, mask
            ),
            "old_logprobs must be finite on response tokens": nonfinite_on(old_logprobs, mask),
        }
    )
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    log_w = torch.where(mask, old_logprobs.to(dtype) - rollout_logprobs.to(dtype), 0.0)
    num_tokens = mask.sum(dtype=dtype)
    metric_sums: dict[str, Tensor] = {
        # KL(pi_rollout || pi_old) on rollout samples, k3 with r = pi_old / pi_rollout.
        "mismatch_kl/sum": (torch.expm1(log_w.clamp(max=LOG_RATIO_CLAMP)) - log_w).sum(),
        "mismatch_kl/count": num_tokens,
    }

    if level == "token":
        weights = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        on, item_weight, count = mask, mask.to(dtype), num_tokens
    else:
        stacked = torch.stack([mask.sum(-1, dtype=dtype), log_w.sum(-1)])
        lengths, log_w_sum = stacked.unbind(0) if seq_sum is None else seq_sum(stacked).unbind(0)
        if level == "geometric":
            log_w_sum = log_w_sum / lengths.clamp(min=1.0)
        weights = torch.exp(log_w_sum.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        on = lengths > 0.5
        share = torch.ones_like(lengths) if seq_share is None else seq_share.to(dtype)
        item_weight = torch.where(on, share, 0.0)
        count = item_weight.sum()

    corrected = torch.zeros_like(on)
    if mode != "none":
        weights, corrected = MISMATCH_MODES[mode](weights, cap, lower, upper)
    weights = torch.where(on, weights, 0.0 if level == "token" else 1.0)
    inf = torch.tensor(float("inf"), dtype=dtype, device=weights.device)
    metric_sums |= {
        "mismatch_is_weight_mean/sum": (weights * item_weight).sum(),
        "mismatch_is_weight_mean/count": count,
        "mismatch_is_weight_max/max": torch.where(on, weights, -inf).max(),
        "mismatch_corrected_fraction/sum": (corrected & on).to(dtype).mul(item_weight).sum(),
        "mismatch_corrected_fraction/count": count,
    }
    return MismatchCorrection(
        old_logprobs=old_logprobs,
        is_weights=weights if mode != "none" else None,
        metric_sums=metric_sums,
    )


def rollout_mismatch_sums(
    rollout_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor, threshold: float
) -> dict[str, Tensor]:
    """How far the rollout engine and the trainer disagree on the tokens the engine sampled, as
    metric sums (``metrics.finalize_metrics``), per token t of the mask ([B, T] each):

    - ``k3_kl``: KL(pi_rollout || pi_trainer) by the k3 estimator on the rollout's own samples,
      r - 1 - log r with log r = log pi_trainer - log pi_rollout (unbiased, >= 0; Schulman's
      k3, as the R3 paper measures it);
    - ``tokens_past_threshold``: the fraction with |log pi_trainer - log pi_rollout| >
      ``threshold``;
    - ``logprob_abs_diff_mean`` / ``logprob_abs_diff_max``: the absolute log-prob difference.

    Log-ratios are clamped to [-20, 20] before exp, as in the losses.
    """
    rollout_logprobs = require_tensor("rollout_logprobs", rollout_logprobs, floating=True)
    trainer_logprobs = require_tensor("trainer_logprobs", trainer_logprobs, floating=True)
    require_shape("trainer_logprobs", trainer_logprobs, shape(rollout_logprobs), "its shape")
    mask = require_tensor("mask", mask) != 0
    require_shape("mask", mask, shape(rollout_logprobs), "the log-probs' shape")
    threshold = require_number("threshold", threshold, minimum=0.0, strict=True)
    dtype = torch.promote_types(rollout_logprobs.dtype, torch.float32)
    log_r = torch.where(mask, trainer_logprobs.to(dtype) - rollout_logprobs.to(dtype), 0.0)
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tokens = mask.sum().to(dtype)
    diff = log_r.abs()
    return {
        "k3_kl/sum": torch.where(mask, torch.expm1(log_r) - log_r, 0.0).sum(),
        "k3_kl/count": tokens,
        "tokens_past_threshold/sum": (mask & (diff > threshold)).sum().to(dtype),
        "tokens_past_threshold/count": tokens,
        "logprob_abs_diff_mean/sum": diff.sum(),
        "logprob_abs_diff_mean/count": tokens,
        "logprob_abs_diff_max/max": torch.where(mask, diff, -torch.inf).max(),
    }
