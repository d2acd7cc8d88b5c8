"""DAPO and DUPO batch pieces: dynamic-sampling filters, overlong filtering and punishment.

Rewards here are [num_groups, G]: one row per prompt, one column per rollout.

- DAPO (arXiv 2503.14476) dynamic sampling drops groups whose rewards are all equal (zero
  advantage, no gradient) and samples more prompts until the batch is full: the trainer calls
  :func:`informative_groups` / :func:`dapo_keep_indices` on each generation round.
- DUPO (WebSailor, arXiv 2507.02592) fills the slots of zero-variance groups with duplicates of
  informative groups of the same batch (:func:`dupo_fill_indices`), and before RL drops prompts
  that every rollout solves (:func:`prefilter_solved_prompts`).
- Overlong filtering (DAPO) masks the loss of truncated responses (:func:`overlong_filter_mask`);
  soft overlong punishment (DAPO eq. 13) is a length-dependent reward penalty
  (:func:`soft_overlong_penalty`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import require_number, require_shape, require_tensor


def _grouped(rewards: Tensor) -> Tensor:
    rewards = require_tensor("rewards", rewards)
    if rewards.dim() != 2 or rewards.shape[1] == 0:
        raise ValueError(f"rewards must be [num_groups, G] with G >= 1, got {list(rewards.shape)}")
    return rewards


def informative_groups(rewards: Tensor, *, atol: float = 0.0) -> Tensor:
    """[num_groups] bool: the group's rewards are not all equal (max - min > atol)."""
    rewards = _grouped(rewards)
    atol = require_number("atol", atol, minimum=0.0)
    return (rewards.amax(dim=1) - rewards.amin(dim=1)) > atol


def dapo_keep_indices(
    rewards: Tensor, *, max_groups: int | None = None, atol: float = 0.0
) -> Tensor:
    """DAPO dynamic sampling: indices (in order) of informative groups, at most ``max_groups``.

    The trainer keeps these, and generates for more prompts while it has fewer than it needs.
    """
    keep = torch.nonzero(informative_groups(rewards, atol=atol)).flatten()
    if max_groups is not None:
        max_groups = int(require_number("max_groups", max_groups, minimum=0.0))
        keep = keep[:max_groups]
    return keep


def dupo_fill_indices(
    rewards: Tensor,
    *,
    num_groups: int | None = None,
    generator: torch.Generator | None = None,
    atol: float = 0.0,
) -> Tensor:
    """DUPO: group indices filling ``num_groups`` slots (default: all of them) from this batch.

    The informative groups come first, in order; each remaining slot holds a duplicate of an
    informative group, drawn at random without replacement until every informative group has
    been used once more, then again. Empty if no group is informative (nothing to learn from).
    """
    informative = torch.nonzero(informative_groups(rewards, atol=atol)).flatten()
    total = rewards.shape[0] if num_groups is None else num_groups
    total = int(require_number("num_groups", total, minimum=0.0))
    if informative.numel() == 0:
        return informative
    if informative.numel() >= total:
        return informative[:total]
    fills = []
    missing = total - informative.numel()
    while missing > 0:
        perm = torch.randperm(informative.numel(), generator=generator)[:missing]
        fills.append(informative[perm.to(informative.device)])
        missing -= perm.numel()
    return torch.cat([informative, *fills])


def prefilter_solved_prompts(rewards: Tensor, *, solved_reward: float = 1.0) -> Tensor:
    """DUPO's pre-filter: [num_prompts] bool, true for prompts to keep — those that not every
    rollout solves (a rollout with reward >= ``solved_reward`` counts as solved)."""
    rewards = _grouped(rewards)
    solved_reward = require_number("solved_reward", solved_reward)
    return ~(rewards >= solved_reward).all(dim=1)


def overlong_filter_mask(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: ``response_mask`` with the rows of truncated responses cleared.

    Args:
        response_mask: [B, T] bool or 0/1.
        truncated: [B] bool, true where generation stopped at the length limit.
    """
    response_mask = require_tensor("response_mask", response_mask)
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got {list(response_mask.shape)}")
    truncated = require_tensor("truncated", truncated)
    require_shape("truncated", truncated, list(response_mask.shape[:1]), "one flag per response")
    return (response_mask != 0) & ~(truncated != 0)[:, None]


def soft_overlong_penalty(
    response_lengths: Tensor, max_response_length: int, cache_length: int
) -> Tensor:
    """DAPO soft overlong punishment, added to the reward:

    0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <=
    L_max; -1 beyond. ``max_response_length`` is L_max, ``cache_length`` is L_cache.
    """
    lengths = require_tensor("response_lengths", response_lengths)
    max_len = require_number("max_response_length", max_response_length, minimum=0.0, strict=True)
    cache = require_number("cache_length", cache_length, minimum=0.0, strict=True)
    if cache > max_len:
        raise ValueError(f"cache_length ({cache:g}) must be <= max_response_length ({max_len:g})")
    y = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    expected = max_len - cache
    penalty = ((expected - y) / cache).clamp(max=0.0)
    return torch.where(y > max_len, torch.full_like(y, -1.0), penalty)
