"""Variable-length prompt+response sequences -> padded micro-batches for megatron.

Layout conventions (every per-token array is aligned with the *label* position): position t of a
micro-batch holds input token x_t and predicts label x_{t+1}; `loss_mask[t]` is 1 when x_{t+1} is
a response token; old/reference/rollout log-probs and token advantages at t belong to x_{t+1}.
Sequences are right-padded, so causal attention never lets a real token see padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch

from gspo_megatron.spec.sample import TrainSample


@dataclass
class MicroBatch:
    """Padded tensors for one micro-batch, already split for this CP rank."""

    indices: list[int]  # positions of the samples in the caller's list
    tokens: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] float32, 1 on response labels
    has_label: torch.Tensor  # [b, s] bool, True where a next token exists (t < length - 1)
    advantages: torch.Tensor  # [b] or [b, s] float32
    old_logprobs: torch.Tensor | None = None  # [b, s]
    ref_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # [b, s], or [b] (one weight per sequence)
    routed_experts: torch.Tensor | None = None  # [b, s, layers, top_k] int32 (CP-local)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """A copy with `fn` applied to every tensor."""
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        return replace(self, **changes)

    def to(self, device: torch.device) -> MicroBatch:
        """On `device`; copies from pinned memory do not block the host."""
        return self.map(lambda t: t.to(device, non_blocking=t.is_pinned()))


def split_for_data_parallel(
    samples: Sequence[TrainSample], dp_size: int, dp_rank: int
) -> list[int]:
    """Indices of the samples this DP rank trains on: greedy balance of token counts.

    Deterministic for a given input, so every rank of a TP/CP/PP group picks the same samples.
    """
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].length, i))
    loads = [0] * dp_size
    owner = [0] * len(samples)
    for i in order:
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += samples[i].length
    return [i for i in range(len(samples)) if owner[i] == dp_rank]


def plan_microbatches(lengths: Sequence[int], max_tokens: int, multiple: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose padded size b*s stays <= max_tokens.

    Sequences are taken longest first so similar lengths share a micro-batch (little padding).
    A sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    current_len = 0
    for i in order:
        padded = _round_up(max(current_len, lengths[i]), multiple)
        if current and padded * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, current_len = [], 0
        current.append(i)
        current_len = max(current_len, lengths[i])
    if current:
        groups.append(current)
    return groups


def build_microbatch(
    samples: Sequence[TrainSample],
    indices: Sequence[int],
    *,
    multiple: int,
    pad_id: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    token_advantages: bool = False,
) -> MicroBatch:
    chosen = [samples[i] for i in indices]
    seq_len = _round_up(max(s.length for s in chosen), multiple)
    b = len(chosen)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(b, seq_len, dtype=torch.float32)
    has_label = torch.zeros(b, seq_len, dtype=torch.bool)
    adv = torch.zeros(b, seq_len) if token_advantages else torch.zeros(b)

    def aligned(name: str) -> torch.Tensor | None:
        if all(getattr(s, name) is None for s in chosen):
            return None
        out = torch.zeros(b, seq_len, dtype=torch.float32)
        for row, s in enumerate(chosen):
            values = getattr(s, name)
            if values is None:
                raise ValueError(f"{name} is given for some samples of a micro-batch but not all")
            start = len(s.prompt_ids) - 1
            out[row, start : start + len(values)] = torch.tensor(values, dtype=torch.float32)
        return out

    for row, s in enumerate(chosen):
        ids = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        n = len(ids)
        tokens[row, :n] = ids
        labels[row, : n - 1] = ids[1:]
        has_label[row, : n - 1] = True
        start = len(s.prompt_ids) - 1
        if s.loss_mask is None:
            loss_mask[row, start : n - 1] = 1.0
        else:
            loss_mask[row, start : n - 1] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if token_advantages:
            values = (
                s.advantage if isinstance(s.advantage, list) else [s.advantage] * (n - 1 - start)
            )
            adv[row, start : n - 1] = torch.tensor(values, dtype=torch.float32)
        else:
            if isinstance(s.advantage, list):
                raise ValueError("token-level advantages given to a sequence-level loss")
            adv[row] = float(s.advantage)
    routed = None
    if any(s.routed_experts is not None for s in chosen):
        first = next(s.routed_experts for s in chosen if s.routed_experts is not None)
        # Positions without a recorded route (padding, the last token) get the experts
        # 0..k-1: a valid, duplicate-free choice whose outputs are never used.
        top_k = first.shape[-1]
        routed = (
            torch.arange(top_k, dtype=torch.int32)
            .expand((b, seq_len) + tuple(first.shape[1:]))
            .clone()
        )
        for row, s in enumerate(chosen):
            if s.routed_experts is None:
                raise ValueError("routed experts are given for some samples but not all")
            routes = torch.as_tensor(s.routed_experts, dtype=torch.int32)
            routed[row, : routes.shape[0]] = routes
    position_ids = torch.arange(seq_len).expand(b, seq_len).contiguous()
    sequence_weights = _sequence_weights(chosen)
    batch = MicroBatch(
        indices=list(indices),
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        loss_mask=loss_mask,
        has_label=has_label,
        advantages=adv,
        old_logprobs=aligned("old_logprobs"),
        ref_logprobs=aligned("ref_logprobs"),
        is_weights=sequence_weights if sequence_weights is not None else aligned("is_weights"),
        routed_experts=routed,
    )
    if cp_size > 1:
        batch = split_for_context_parallel(batch, cp_size, cp_rank)
    return batch


def _sequence_weights(chosen: Sequence[TrainSample]) -> torch.Tensor | None:
    """[b] when the samples carry one importance weight each, else None (token weights or none)."""
    per_sequence = [isinstance(s.is_weights, int | float) for s in chosen]
    if not any(per_sequence):
        return None
    if not all(per_sequence):
        raise ValueError("is_weights are one per sequence for some samples of a micro-batch only")
    return torch.tensor([float(s.is_weights) for s in chosen], dtype=torch.float32)


def cp_index(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """Positions this CP rank holds: chunks r and 2*cp-1-r of 2*cp (megatron's load balance)."""
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last * chunk, (last + 1) * chunk, device=device)
    return torch.cat([first, second])


def split_for_context_parallel(batch: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    index = cp_index(batch.tokens.shape[1], cp_size, cp_rank)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.dim() < 2:
            return t
        return t.index_select(1, index).contiguous()

    return MicroBatch(
        indices=batch.indices,
        tokens=take(batch.tokens),
        position_ids=take(batch.position_ids),
        labels=take(batch.labels),
        loss_mask=take(batch.loss_mask),
        has_label=take(batch.has_label),
        advantages=take(batch.advantages),
        old_logprobs=take(batch.old_logprobs),
        ref_logprobs=take(batch.ref_logprobs),
        is_weights=take(batch.is_weights),
        routed_experts=take(batch.routed_experts),
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
