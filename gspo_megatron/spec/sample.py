"""One prompt+response with what the loss needs, as the trainer hands it to a training engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TrainSample:
    """One prompt+response with what the loss needs; response-aligned lists (len == response)."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float | list[float] = 0.0
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    rollout_logprobs: list[float] | None = None
    # Per response token: 0 drops the token from the loss (e.g. overlong filtering); None = all 1.
    loss_mask: list[float] | None = None
    # Train/rollout mismatch weights: one per response token, or one for the whole sequence
    # (sequence and geometric levels; the only form sequence-ratio losses take); None = 1.
    is_weights: float | list[float] | None = None
    # PPO's critic: the value model's predictions when the batch was generated, and the GAE
    # returns it regresses on (one per response token).
    old_values: list[float] | None = None
    returns: list[float] | None = None
    # int32 [prompt_len + response_len - 1, num_moe_layers, top_k]: experts chosen for every
    # consumed token (routing replay); None when not replaying.
    routed_experts: np.ndarray | None = field(default=None, repr=False)
    # Per response token: weight versions between the policy that sampled it and the one that
    # trains on it (the clip fraction is split by it); None = 0 for every token.
    version_lags: list[int] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# Fields with one value per response token (is_weights may also be one float per sequence).
_PER_TOKEN = (
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
    "loss_mask",
    "is_weights",
    "old_values",
    "returns",
    "version_lags",
)
_SEQUENCES = (list, tuple)


def validate_samples(samples: Sequence[TrainSample], max_length: int) -> None:
    for i, sample in enumerate(samples):
        n = len(sample.response_ids)
        if not sample.prompt_ids:
            raise ValueError(f"sample {i}: empty prompt (prompt_ids must hold at least one token)")
        if not n:
            raise ValueError(
                f"sample {i}: empty response (a rollout must produce at least one token; an "
                "immediate stop still yields the stop token)"
            )
        length = len(sample.prompt_ids) + n
        if length > max_length:
            raise ValueError(
                f"sample {i}: prompt+response length {length} exceeds the configured "
                f"maximum sequence length {max_length} (engine.max_sequence_length)"
            )
        for name in _PER_TOKEN:
            values = getattr(sample, name)
            if values is not None and isinstance(values, _SEQUENCES) and len(values) != n:
                raise ValueError(
                    f"sample {i}: {name} has {len(values)} entries for {n} response tokens"
                )
        if isinstance(sample.advantage, list) and len(sample.advantage) != n:
            raise ValueError(
                f"sample {i}: token advantages have {len(sample.advantage)} entries for {n} "
                "response tokens"
            )
