"""Group-relative advantages (GRPO family) and their token broadcast.

A group is the G responses to one prompt. ``group_mean_std`` (GRPO, GSPO, DAPO, SAPO, CISPO,
GMPO): A = (R - mean) / (std + eps). ``group_mean`` (Dr.GRPO): A = R - mean, no std division.
The std is Bessel-corrected by default (``unbiased=True``, as torch.std, TRL and verl compute
it); a group of one response gets advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType

import torch
from torch import Tensor

from ._checks import raise_if_flagged, require_number, require_shape, require_tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    """Advantages of each response relative to its group.

    Args:
        rewards: [num_groups, G] (one row per prompt), or flat [N] together with ``group_ids``.
        group_ids: [N] integer id of each flat reward's group (any values, any order; groups may
            differ in size). Must be None for [num_groups, G] rewards.
        normalize_std: divide by (std + eps) (GRPO); False for mean-only (Dr.GRPO).
        eps: added to the std before dividing.
        unbiased: Bessel-corrected std (divide by n - 1).

    Returns:
        Advantages, same shape as ``rewards``, float (at least float32).
    """
    rewards = require_tensor("rewards", rewards)
    eps = require_number("eps", eps, minimum=0.0)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    raise_if_flagged({"rewards must be finite": ~torch.isfinite(rewards).all()})
    r = rewards.detach().to(dtype)
    if rewards.dim() == 2:
        if group_ids is not None:
            raise ValueError("group_ids must be None when rewards are [num_groups, G]")
        n = r.shape[1]
        mean = r.mean(dim=1, keepdim=True)
        centered = r - mean
        if not normalize_std:
            return centered
        denom = max(n - 1, 1) if unbiased else max(n, 1)
        std = (centered.square().sum(dim=1, keepdim=True) / denom).sqrt()
        return centered / (std + eps)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [num_groups, G] or flat [N], got {list(rewards.shape)}")
    if group_ids is None:
        raise ValueError("group_ids is required with flat [N] rewards")
    group_ids = require_tensor("group_ids", group_ids)
    require_shape("group_ids", group_ids, list(r.shape), "one group id per reward")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num, dtype=dtype, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )
    sums = torch.zeros(num, dtype=dtype, device=r.device).index_add_(0, inverse, r)
    centered = r - (sums / counts)[inverse]
    if not normalize_std:
        return centered
    sq = torch.zeros(num, dtype=dtype, device=r.device).index_add_(0, inverse, centered.square())
    denom = (counts - 1).clamp(min=1) if unbiased else counts
    std = (sq / denom).sqrt()
    return centered / (std[inverse] + eps)


ADVANTAGE_ESTIMATORS: Mapping[str, Callable[..., Tensor]] = MappingProxyType(
    {
        "group_mean_std": partial(group_advantages, normalize_std=True),
        "group_mean": partial(group_advantages, normalize_std=False),
    }
)
"""Estimator name -> ``fn(rewards, group_ids=None, **kw)``; each loss names its paper's choice
in ``POLICY_LOSSES[name].advantage_estimator``."""


def token_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Broadcast per-sequence advantages [B] to response tokens [B, T] (0 outside the mask)."""
    advantages = require_tensor("advantages", advantages, floating=True)
    response_mask = require_tensor("response_mask", response_mask)
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got {list(response_mask.shape)}")
    require_shape("advantages", advantages, list(response_mask.shape[:1]), "one per sequence")
    return torch.where(response_mask != 0, advantages[:, None], 0.0)
