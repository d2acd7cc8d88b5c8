"""PPO's critic side: per-token rewards, GAE, whitening, the clipped value loss, explained variance.

Every [B, T] tensor is response-aligned: position t of row b is response token t, and ``mask``
(float or bool, nonzero = a token the model sampled and that trains) may have holes, e.g. the
observation tokens between the turns of a multi-turn trajectory. Masked-out positions are not
steps of the episode: their rewards and values are ignored and the discount runs over model
tokens only, so an observation between two turns does not decay the return.

Value-loss metrics follow ``metrics.py`` (every ``/sum`` has a ``/count``, the number of masked
tokens, so :func:`~gspo_megatron.algorithms.metrics.finalize_metrics` reports a mean):

- ``value_loss``: mean per-token loss; ``value_clip_fraction``: fraction of tokens whose clipped
  term is the larger one (the gradient is cut there);
- ``values``, ``returns``: mean value V (the current critic's, as passed) and mean return R;
- ``ev_returns_sq``, ``ev_residual``, ``ev_residual_sq``: means of R², R - V and (R - V)², which
  with ``returns`` are the sufficient statistics of :func:`explained_variance_from_sums`. Sums
  reduce by summation across micro-batches and ranks, and every mean is a genuine mean, so no
  finalized number is a misleading total.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._checks import nonfinite_on, raise_if_flagged, require_number, require_shape, require_tensor

_EV_TOLERANCE = 1e-12
"""Var(R) at most this times E[R²] counts as zero in the explained variance (float64 rounding
of E[R²] - E[R]² for constant returns)."""


def _require_mask(mask: object) -> Tensor:
    mask = require_tensor("mask", mask)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got {list(mask.shape)}")
    return mask != 0


def _require_unit_interval(name: str, value: object) -> float:
    value = require_number(name, value, minimum=0.0)
    if value > 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value:g}")
    return value


def token_rewards(
    final_rewards: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Per-token PPO rewards: r_t = -kl_coef * kl_t on masked tokens, plus the sequence's final
    reward at its last masked token (the end of the episode).

    Args:
        final_rewards: [B] reward of each response.
        mask: [B, T] response tokens that train.
        kl: [B, T] per-token KL estimate to the reference policy; required when kl_coef > 0.
        kl_coef: weight of the KL penalty (>= 0).

    Returns:
        [B, T] detached rewards (at least float32), 0 outside the mask. A row without masked
        token is all zeros: it has no step to carry its final reward, which is dropped.
    """
    m = _require_mask(mask)
    final_rewards = require_tensor("final_rewards", final_rewards)
    require_shape("final_rewards", final_rewards, list(m.shape[:1]), "one per sequence")
    kl_coef = require_number("kl_coef", kl_coef, minimum=0.0)
    if kl is not None:
        kl = require_tensor("kl", kl)
        require_shape("kl", kl, list(m.shape), "the shape of mask")
    elif kl_coef > 0:
        raise ValueError("kl is required when kl_coef > 0")
    flags = {"final_rewards must be finite": ~torch.isfinite(final_rewards).all()}
    if kl is not None:
        flags["kl must be finite on masked tokens"] = nonfinite_on(kl, m)
    raise_if_flagged(flags)

    dtype = torch.promote_types(final_rewards.dtype, torch.float32)
    if kl is not None:
        dtype = torch.promote_types(dtype, kl.dtype)
    counts = m.long().cumsum(dim=1)
    last = m & (counts == counts[:, -1:])  # the last masked token of each row
    rewards = torch.where(last, final_rewards.detach().to(dtype)[:, None], 0.0)
    if kl is not None and kl_coef > 0:
        rewards = rewards - kl_coef * torch.where(m, kl.detach().to(dtype), 0.0)
    return rewards


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the masked tokens of each row.

    The steps of row b are its masked positions t_1 < ... < t_n. With V after the last step 0
    (the episode ends there):

        delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}
        A_k = delta_k + gamma * lam * A_{k+1},   returns_k = A_k + V_{t_k}

    Args:
        rewards: [B, T] per-token rewards (e.g. from :func:`token_rewards`).
        values: [B, T] critic values of the rollout (old values).
        mask: [B, T] response tokens that train; other positions are skipped, not stepped.
        gamma: discount per model token, in [0, 1].
        lam: GAE lambda, in [0, 1] (0: one-step TD, 1: Monte-Carlo return minus V).

    Returns:
        (advantages, returns), both [B, T], detached, at least float32, 0 outside the mask.
    """
    m = _require_mask(mask)
    rewards = require_tensor("rewards", rewards)
    require_shape("rewards", rewards, list(m.shape), "the shape of mask")
    values = require_tensor("values", values)
    require_shape("values", values, list(m.shape), "the shape of mask")
    gamma = _require_unit_interval("gamma", gamma)
    lam = _require_unit_interval("lam", lam)
    raise_if_flagged(
        {
            "rewards must be finite on masked tokens": nonfinite_on(rewards, m),
            "values must be finite on masked tokens": nonfinite_on(values, m),
        }
    )

    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    r = torch.where(m, rewards.detach().to(dtype), 0.0)
    v = torch.where(m, values.detach().to(dtype), 0.0)
    next_value = torch.zeros(m.shape[0], dtype=dtype, device=m.device)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(r)
    # One reverse sweep; the carried "next step" only moves at masked positions, so holes are
    # skipped without decaying the return.
    for t in reversed(range(m.shape[1])):
        on = m[:, t]
        adv_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        advantages[:, t] = adv_t
        next_adv = torch.where(on, adv_t, next_adv)
        next_value = torch.where(on, v[:, t], next_value)
    advantages = torch.where(m, advantages, 0.0)
    return advantages, torch.where(m, advantages + v, 0.0)


def masked_whiten(
    values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries of the whole batch.

    The statistics span every row given, so data-parallel callers pass the whole batch (this
    project holds it on every rank) rather than a rank's shard. The variance is Bessel-corrected
    like torch.var when there is more than one masked entry, else 0. With ``shift_mean=False``
    the mean is added back after scaling (verl's convention for advantages).

    Returns:
        Same shape as ``values``, detached, at least float32, 0 outside the mask.
    """
    values = require_tensor("values", values)
    mask = require_tensor("mask", mask)
    require_shape("values", values, list(mask.shape), "the shape of mask")
    eps = require_number("eps", eps, minimum=0.0)
    m = mask != 0
    raise_if_flagged({"values must be finite on masked tokens": nonfinite_on(values, m)})

    x = torch.where(m, values.detach().to(torch.promote_types(values.dtype, torch.float32)), 0.0)
    n = m.sum()
    mean = x.sum() / n.clamp(min=1)
    centered = torch.where(m, x - mean, 0.0)
    var = centered.square().sum() / (n - 1).clamp(min=1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


@dataclass
class ValueLossTerms:
    """One micro-batch's (and rank's) share of the PPO value loss.

    Attributes:
        loss_sum: scalar, differentiable in ``values``: Σ over masked tokens of the per-token
            loss; the caller divides by the global token count (docs/ARCHITECTURE.md §4).
        metric_sums: detached float64 tensors keyed ``"<metric>/sum|count"`` (module docstring).
    """

    loss_sum: Tensor
    metric_sums: dict[str, Tensor] = field(default_factory=dict)


def value_loss_terms(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None
) -> ValueLossTerms:
    """PPO's clipped value loss, summed over masked tokens.

    Per token 0.5 * max((v - R)², (v_clip - R)²), v_clip = old_v + clamp(v - old_v, -clip, clip):
    the critic may not move a value further than ``clip`` from the rollout's in one update when
    that would reduce the error. ``clip`` None or 0 gives the unclipped 0.5 * (v - R)².

    Args:
        values: [B, T] current critic values (the only input that gets a gradient).
        old_values: [B, T] critic values of the rollout.
        returns: [B, T] GAE returns (targets).
        mask: [B, T] response tokens that train.
        clip: clip range (>= 0), or None.
    """
    m = _require_mask(mask)
    values = require_tensor("values", values, floating=True)
    require_shape("values", values, list(m.shape), "the shape of mask")
    old_values = require_tensor("old_values", old_values)
    require_shape("old_values", old_values, list(m.shape), "the shape of mask")
    returns = require_tensor("returns", returns)
    require_shape("returns", returns, list(m.shape), "the shape of mask")
    if clip is not None:
        clip = require_number("clip", clip, minimum=0.0)
    raise_if_flagged(
        {
            f"{name} must be finite on masked tokens": nonfinite_on(t, m)
            for name, t in (("values", values), ("old_values", old_values), ("returns", returns))
        }
    )

    # Positions outside the mask are replaced by 0 (not multiplied by it), so padding values —
    # even NaN/inf — reach neither the loss nor the gradient.
    dtype = torch.promote_types(values.dtype, torch.float32)
    v = torch.where(m, values.to(dtype), 0.0)
    old = torch.where(m, old_values.detach().to(dtype), 0.0)
    ret = torch.where(m, returns.detach().to(dtype), 0.0)
    loss = (v - ret).square()
    clipped = torch.zeros_like(m)
    if clip:
        v_clip = old + (v - old).clamp(-clip, clip)
        loss_clip = (v_clip - ret).square()
        clipped = m & (loss_clip > loss)
        loss = torch.where(clipped, loss_clip, loss)
    loss = 0.5 * torch.where(m, loss, 0.0)

    with torch.no_grad():
        f64 = torch.float64
        count = m.sum().to(f64)
        vd, rd = v.detach().to(f64), ret.to(f64)
        residual = rd - vd
        means = {
            "value_loss": loss.detach().to(f64),
            "value_clip_fraction": clipped.to(f64),
            "values": vd,
            "returns": rd,
            "ev_returns_sq": rd.square(),
            "ev_residual": residual,
            "ev_residual_sq": residual.square(),
        }
        metric_sums: dict[str, Tensor] = {}
        for name, x in means.items():
            metric_sums[f"{name}/sum"] = x.sum()
            metric_sums[f"{name}/count"] = count
    return ValueLossTerms(loss_sum=loss.sum(), metric_sums=metric_sums)


def _explained_variance(
    mean_r: float, mean_r_sq: float, mean_res: float, mean_res_sq: float
) -> float:
    var_r = mean_r_sq - mean_r**2
    if var_r <= _EV_TOLERANCE * mean_r_sq:
        return 0.0
    return 1.0 - max(mean_res_sq - mean_res**2, 0.0) / var_r


def explained_variance_from_sums(totals: Mapping[str, float]) -> float:
    """1 - Var(R - V) / Var(R) (population variances) from finalized value-loss metrics.

    ``totals`` is the output of :func:`~gspo_megatron.algorithms.metrics.finalize_metrics` on
    fully reduced :class:`ValueLossTerms` metric sums (keys ``returns``, ``ev_returns_sq``,
    ``ev_residual``, ``ev_residual_sq``). Returns 0.0 when Var(R) is 0 (constant returns, or no
    token), following ``metrics.py``'s "nothing to measure is 0.0" rather than NaN.
    """
    return _explained_variance(
        float(totals["returns"]),
        float(totals["ev_returns_sq"]),
        float(totals["ev_residual"]),
        float(totals["ev_residual_sq"]),
    )


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens, in float64 (same convention as
    :func:`explained_variance_from_sums`, 0.0 when Var(R) is 0)."""
    m = _require_mask(mask)
    values = require_tensor("values", values)
    require_shape("values", values, list(m.shape), "the shape of mask")
    returns = require_tensor("returns", returns)
    require_shape("returns", returns, list(m.shape), "the shape of mask")
    raise_if_flagged(
        {
            "values must be finite on masked tokens": nonfinite_on(values, m),
            "returns must be finite on masked tokens": nonfinite_on(returns, m),
        }
    )
    r = returns.detach().double()[m]
    if r.numel() == 0:
        return 0.0
    residual = r - values.detach().double()[m]
    var_r = r.var(unbiased=False).item()
    if var_r <= _EV_TOLERANCE * r.square().mean().item():
        return 0.0
    return 1.0 - residual.var(unbiased=False).item() / var_r
