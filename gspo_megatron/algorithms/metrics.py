"""Metric sums that add up across micro-batches and ranks, and batch metrics of a rollout.

Convention for ``metric_sums`` (as returned in :class:`~gspo_megatron.algorithms.LossTerms`):
every key is ``"<metric>/<kind>"``:

- ``"<metric>/sum"`` with a matching ``"<metric>/count"``: a mean, reported as sum / count after
  both are summed over micro-batches and ranks (SUM reduction). A ``/sum`` without a ``/count``
  is reported as the total itself.
- ``"<metric>/max"``: reduced with MAX; ``"<metric>/min"``: reduced with MIN. Their identity
  values (-inf / +inf) mean "nothing measured here".

So a caller reduces each key with :func:`metric_reduce_op` and calls :func:`finalize_metrics`
once. A metric with nothing to measure (count 0, or an extreme never set) is reported as 0.0;
a non-finite value that was measured (a NaN sum or extreme) is reported as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal

import torch
from torch import Tensor

from ._checks import require_shape, require_tensor

ReduceOp = Literal["sum", "max", "min"]


def metric_reduce_op(key: str) -> ReduceOp:
    """How ``key`` of a ``metric_sums`` dict combines across micro-batches and ranks."""
    if key.endswith("/max"):
        return "max"
    if key.endswith("/min"):
        return "min"
    if key.endswith(("/sum", "/count")):
        return "sum"
    raise ValueError(f"metric key {key!r} must end with /sum, /count, /max or /min")


def merge_metric_sums(parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine the ``metric_sums`` of several micro-batches (on one rank) key by key."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            value = value.detach()
            if key not in merged:
                merged[key] = value.clone()
                continue
            op = metric_reduce_op(key)
            if op == "sum":
                merged[key] = merged[key] + value
            elif op == "max":
                merged[key] = torch.maximum(merged[key], value)
            else:
                merged[key] = torch.minimum(merged[key], value)
    return merged


def finalize_metrics(
    metric_sums: Mapping[str, Tensor | float], *, omit_empty: tuple[str, ...] = ()
) -> dict[str, float]:
    """Turn fully reduced metric sums into plain floats named by metric (no ``/kind`` suffix).
    Means whose name starts with one of `omit_empty` are left out when their count is 0 (a
    bucket nothing fell into), instead of reported as 0.0."""
    values = {k: float(v) for k, v in metric_sums.items()}
    out: dict[str, float] = {}
    for key, value in values.items():
        name, _, kind = key.rpartition("/")
        metric_reduce_op(key)  # validates the suffix
        if kind == "count":
            continue
        if kind == "sum" and f"{name}/count" in values:
            count = values[f"{name}/count"]
            if count <= 0 and name.startswith(omit_empty) and omit_empty:
                continue
            out[name] = value / count if count > 0 else 0.0
        elif kind in ("max", "min") and math.isinf(value):
            out[name] = 0.0  # the reduction's identity: nothing was measured
        else:
            out[name] = value  # a non-finite total stays visible (a NaN loss is not 0)
    return out


# The clip fraction split by token groups (policy_loss_terms' token_buckets): names
# clip_fraction_<group>_<label>, left out of the finalized metrics when empty.
CLIP_BUCKET_PREFIX = "clip_fraction_"
LAG_BUCKETS = ("0", "1", "2plus")
LENGTH_BUCKETS = ("q1", "q2", "q3", "q4")


def clip_buckets(
    version_lags: Tensor | None, response_lengths: Tensor | None, max_new_tokens: int
) -> dict[str, tuple[Tensor, tuple[str, ...]]]:
    """The groups ``policy_loss_terms`` splits the clip fraction by: "lag", each token's weight
    versions between the policy that sampled it and the one that trains on it (0, 1, >= 2;
    [B, T]); "length", the response's length in quarters of ``max_new_tokens`` (q1: at most a
    quarter, ..., q4: more than three quarters; [B]). A group whose input is None (or
    ``max_new_tokens`` 0) is left out."""
    out: dict[str, tuple[Tensor, tuple[str, ...]]] = {}
    if version_lags is not None:
        out["lag"] = (version_lags.round().clamp(0, 2).long(), LAG_BUCKETS)
    if response_lengths is not None and max_new_tokens > 0:
        quarter = torch.ceil(4.0 * response_lengths.double() / max_new_tokens).long() - 1
        out["length"] = (quarter.clamp(0, 3), LENGTH_BUCKETS)
    return out


def rollout_metrics(
    rewards: Tensor,
    response_lengths: Tensor | None = None,
    truncated: Tensor | None = None,
    *,
    solved_reward: float = 1.0,
) -> dict[str, float]:
    """Batch statistics of one rollout step, as plain floats named as the trainer logs them
    (`reward/`, `response/`, `sampling/`).

    Args:
        rewards: [num_groups, G] rewards, one row per prompt.
        response_lengths: [num_groups, G] or [num_groups * G] response token counts (optional).
        truncated: same shape as ``response_lengths``, true where generation hit the length cap.
        solved_reward: a rollout with reward >= this counts as solved.
    """
    rewards = require_tensor("rewards", rewards)
    if rewards.dim() != 2 or rewards.numel() == 0:
        raise ValueError(
            f"rewards must be [num_groups, G] and non-empty, got {list(rewards.shape)}"
        )
    r = rewards.double()
    spread = r.amax(dim=1) - r.amin(dim=1)
    solved = r >= solved_reward
    out = {
        "reward/mean": r.mean().item(),
        "reward/std": r.std().item() if r.numel() > 1 else 0.0,
        "reward/accuracy": solved.double().mean().item(),
        "reward/solved_all_fraction": solved.all(dim=1).double().mean().item(),
        "reward/solved_none_fraction": (~solved).all(dim=1).double().mean().item(),
        "sampling/groups_generated": float(r.shape[0]),
        "sampling/groups_zero_variance": float((spread == 0).sum().item()),
    }
    if response_lengths is not None:
        lengths = require_tensor("response_lengths", response_lengths).reshape(-1).double()
        require_shape("response_lengths", lengths, [r.numel()], "one length per rollout")
        out |= {
            "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/length_min": lengths.min().item(),
            "response/tokens": lengths.sum().item(),
        }
    if truncated is not None:
        flags = require_tensor("truncated", truncated).reshape(-1)
        require_shape("truncated", flags, [r.numel()], "one flag per rollout")
        out["response/truncated_fraction"] = flags.double().mean().item()
    return out
