"""Group-relative advantages (GRPO family), their token broadcast, and per-turn credit.

A group is the G responses to one prompt. ``group_mean_std`` (GRPO, GSPO, DAPO, SAPO, CISPO,
GMPO): A = (R - mean) / (std + eps). ``group_mean`` (Dr.GRPO): A = R - mean, no std division.
The std is Bessel-corrected by default (``unbiased=True``, as torch.std, TRL and verl compute
it); a group of one response gets advantage 0.

Per-turn credit (multi-turn episodes, ``turn_advantages``): episode b of a group has model turns
k = 0..n_b-1 with rewards r_bk (the environment's reward for that turn; the last turn also
carries the episode's final score). Each turn's discounted return is the reward-to-go

    G_bk = sum_{j=k}^{n_b-1} gamma^(j-k) r_bj        (gamma per model turn, not per token)

and its advantage is G_bk against the other episodes of the same group at the same turn index,
with the same estimator as above (mean and std over {G_b'k : episode b' of the group has a turn
k}; a turn index only one episode of its group reaches gets 0). Every token of turn k gets
A_bk (``turn_token_advantages``). With gamma = 1, G_b0 is the episode's total reward, so the
first turn's advantage is the episode-level advantage; later turns are no longer credited with
rewards earned before them.
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


def _turn_layout(turn_rewards: Tensor, turn_mask: Tensor) -> tuple[Tensor, Tensor]:
    turn_rewards = require_tensor("turn_rewards", turn_rewards)
    if turn_rewards.dim() != 2:
        raise ValueError(f"turn_rewards must be [B, K], got {list(turn_rewards.shape)}")
    turn_mask = require_tensor("turn_mask", turn_mask)
    require_shape("turn_mask", turn_mask, list(turn_rewards.shape), "the shape of turn_rewards")
    m = turn_mask != 0
    # Turns are 0..n_b-1: a mask with a hole would give a turn index two meanings.
    raise_if_flagged(
        {
            "turn_mask must mark turns 0..n-1 of each episode (no hole)": (
                m[:, 1:] & ~m[:, :-1]
            ).any(),
            "turn_rewards must be finite on turns": (m & ~torch.isfinite(turn_rewards)).any(),
        }
    )
    return turn_rewards, m


def turn_returns(turn_rewards: Tensor, turn_mask: Tensor, gamma: float) -> Tensor:
    """Discounted reward-to-go of each turn (module docstring).

    Args:
        turn_rewards: [B, K] reward of turn k of episode b (anything outside ``turn_mask``).
        turn_mask: [B, K] nonzero on the turns episode b has (turns 0..n_b-1).
        gamma: discount per model turn, in [0, 1].

    Returns:
        [B, K] returns (at least float32), 0 outside the mask.
    """
    turn_rewards, m = _turn_layout(turn_rewards, turn_mask)
    gamma = require_number("gamma", gamma, minimum=0.0)
    if gamma > 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma:g}")
    dtype = torch.promote_types(turn_rewards.dtype, torch.float32)
    r = torch.where(m, turn_rewards.detach().to(dtype), 0.0)
    returns = torch.zeros_like(r)
    following = torch.zeros(r.shape[0], dtype=dtype, device=r.device)
    for k in reversed(range(r.shape[1])):
        following = r[:, k] + gamma * following
        returns[:, k] = following
    return torch.where(m, returns, 0.0)


def turn_advantages(
    turn_rewards: Tensor,
    turn_mask: Tensor,
    group_ids: Tensor,
    gamma: float,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    """Per-turn advantages: each turn's return against its group at the same turn index.

    Args:
        turn_rewards, turn_mask, gamma: as in :func:`turn_returns`.
        group_ids: [B] integer id of each episode's group (the prompt it answers).
        normalize_std, eps, unbiased: as in :func:`group_advantages` (``group_mean_std``:
            True; ``group_mean``: False).

    Returns:
        [B, K] advantages (at least float32), 0 outside the mask.
    """
    returns = turn_returns(turn_rewards, turn_mask, gamma)
    m = turn_mask != 0
    group_ids = require_tensor("group_ids", group_ids)
    require_shape("group_ids", group_ids, list(returns.shape[:1]), "one group id per episode")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    _, group = torch.unique(group_ids, return_inverse=True)
    turns = returns.shape[1]
    index = torch.arange(turns, device=returns.device)
    # One baseline group per (prompt group, turn index).
    cell = group.to(returns.device)[:, None] * turns + index[None, :]
    advantages = torch.zeros_like(returns)
    if m.any():
        advantages[m] = group_advantages(
            returns[m], cell[m], normalize_std=normalize_std, eps=eps, unbiased=unbiased
        )
    return advantages


def turn_token_advantages(advantages: Tensor, token_turns: Tensor) -> Tensor:
    """Broadcast per-turn advantages [B, K] to tokens [B, T]: token t of row b gets
    advantages[b, token_turns[b, t]]; 0 where token_turns is -1 (an observation, padding)."""
    advantages = require_tensor("advantages", advantages, floating=True)
    token_turns = require_tensor("token_turns", token_turns)
    if advantages.dim() != 2 or token_turns.dim() != 2:
        raise ValueError(
            f"advantages must be [B, K] and token_turns [B, T], got "
            f"{list(advantages.shape)} and {list(token_turns.shape)}"
        )
    if token_turns.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"token_turns has {token_turns.shape[0]} rows for {advantages.shape[0]} episodes"
        )
    if token_turns.is_floating_point():
        raise ValueError(f"token_turns must be an integer tensor, got {token_turns.dtype}")
    raise_if_flagged(
        {
            f"token_turns must be -1 or a turn index below {advantages.shape[1]}": (
                (token_turns < -1) | (token_turns >= advantages.shape[1])
            ).any()
        }
    )
    on = token_turns >= 0
    picked = advantages.gather(1, token_turns.clamp(min=0).long())
    return torch.where(on, picked, 0.0)


def turn_end_rewards(
    turn_rewards: Tensor, token_turns: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Per-token rewards [B, T] for PPO's GAE (algorithms/gae.py) with per-turn credit: turn
    k's reward on its last token, or, with ``mask`` (the tokens that train), on the last
    trained token at or before it (GAE skips the others). A turn with no trained token at or
    before its end precedes nothing that trains: its reward is dropped.

    Args:
        turn_rewards: [B, K] reward of each turn.
        token_turns: [B, T] turn index of each token, -1 for none (observations, padding).
        mask: [B, T] tokens that train; None: every token of a turn.
    """
    turn_rewards = require_tensor("turn_rewards", turn_rewards)
    token_turns = require_tensor("token_turns", token_turns).long()
    on = token_turns >= 0
    following = torch.full_like(token_turns, -1)
    following[:, :-1] = token_turns[:, 1:]
    last = on & (following != token_turns)  # the last token of each turn
    trained = on if mask is None else on & (mask != 0)
    positions = torch.arange(token_turns.shape[1], device=token_turns.device).expand_as(token_turns)
    # the latest trained position at or before each position (-1: none yet)
    target = torch.where(trained, positions, -1).cummax(dim=1).values
    dtype = torch.promote_types(turn_rewards.dtype, torch.float32)
    picked = turn_rewards.detach().to(dtype).gather(1, token_turns.clamp(min=0))
    placed = last & (target >= 0)
    out = torch.zeros(token_turns.shape, dtype=dtype, device=token_turns.device)
    return out.scatter_add_(1, target.clamp(min=0), torch.where(placed, picked, 0.0))
