"""Variable-length prompt+response sequences -> micro-batches for megatron, padded or packed.

Layout conventions (every per-token array is aligned with the *label* position): position t of a
sequence holds input token x_t and predicts label x_{t+1}; `loss_mask[t]` is 1 when x_{t+1} is
a response token; old/reference/rollout log-probs and token advantages at t belong to x_{t+1}.

A micro-batch has two layouts. The *model layout* is what the model sees: padded, [b, s] rows
right-padded to one length; packed, one [1, T] row of the sequences end to end, with their
boundaries (`cu_seqlens`) given to attention and RoPE as megatron's THD format. The *row layout*
is what the loss sees: one row per sequence, [b, s_row]. Padding inside a packed sequence (to the
multiple context parallelism needs) is the tail of that sequence, so causal attention never lets
a real token see it, and the boundaries with and without that padding are the same.
Under context parallelism every sequence is cut into 2*cp chunks and a rank holds chunks r and
2*cp-1-r of each (megatron's load balance, per sequence for THD).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch

from gspo_megatron.spec.sample import TrainSample


@dataclass
class MicroBatch:
    """One micro-batch, already split for this CP rank.

    Model layout: tokens, position_ids, labels, has_label, routed_experts. Row layout: loss_mask,
    advantages, old/ref log-probs, is_weights, old_values, returns, version_lags. `row_index`
    maps the flattened model layout to the row layout (None when both are the same, i.e.
    padded).
    """

    indices: list[int]  # positions of the samples in the caller's list
    tokens: torch.Tensor  # [b, s] or [1, T] int64
    position_ids: torch.Tensor  # like tokens; restart at 0 in every sequence
    labels: torch.Tensor  # like tokens
    has_label: torch.Tensor  # like tokens, bool: True where a next token exists
    loss_mask: torch.Tensor  # [b, s_row] float32, 1 on response labels
    advantages: torch.Tensor  # [b] or [b, s_row] float32
    seq_lengths: torch.Tensor  # [b] int64: each sequence's length with its padding, before CP
    row_index: torch.Tensor | None = None  # [b, s_row] int64 into the flat model layout; T = none
    cu_seqlens: torch.Tensor | None = None  # [b + 1] int32, packed only (global positions)
    max_seqlen: int = 0  # longest sequence with its padding, packed only
    old_logprobs: torch.Tensor | None = None  # [b, s_row]
    ref_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # [b, s_row], or [b] (one weight per sequence)
    old_values: torch.Tensor | None = None  # [b, s_row], the critic's
    returns: torch.Tensor | None = None  # [b, s_row]
    routed_experts: torch.Tensor | None = None  # model layout + [layers, top_k] int32
    version_lags: torch.Tensor | None = None  # [b, s_row] float32 (whole numbers)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """Model-layout values ([b, s, ...] or [1, T, ...]) in the row layout; zeros past a
        sequence's end. Differentiable."""
        if self.row_index is None:
            return values
        flat = values.reshape((-1,) + tuple(values.shape[2:]))
        flat = torch.cat([flat, flat.new_zeros((1,) + tuple(flat.shape[1:]))])
        return flat[self.row_index]

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


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def split_for_data_parallel(lengths: Sequence[int], dp_size: int, dp_rank: int) -> list[int]:
    """Indices of the sequences this DP rank trains on: greedy balance of token counts.

    Deterministic for a given input, so every rank of a TP/CP/PP group picks the same samples.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * dp_size
    owner = [0] * len(lengths)
    for i in order:
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == dp_rank]


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
        padded = padded_length(max(current_len, lengths[i]), multiple)
        if current and padded * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, current_len = [], 0
        current.append(i)
        current_len = max(current_len, lengths[i])
    if current:
        groups.append(current)
    return groups


def karmarkar_karp(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `costs` in `parts` groups of nearly equal sums: the largest differencing
    method (Karmarkar and Karp, 1982) for multiway number partitioning. Deterministic; no group
    is empty when there are at least `parts` items."""
    if len(costs) < parts:
        raise ValueError(f"{len(costs)} items cannot fill {parts} groups")
    heap = []
    for i, cost in enumerate(costs):
        groups = [(cost, [i])] + [(0, []) for _ in range(parts - 1)]
        heap.append((-cost, i, groups))
    heapq.heapify(heap)
    tiebreak = len(costs)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # Largest group of one with the smallest of the other: the difference shrinks.
        merged = [
            (first[j][0] + second[parts - 1 - j][0], first[j][1] + second[parts - 1 - j][1])
            for j in range(parts)
        ]
        merged.sort(key=lambda group: (-group[0], group[1][:1]))
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tiebreak, merged))
        tiebreak += 1
    groups = [list(items) for _, items in heap[0][2]]
    for empty in [g for g in groups if not g]:
        donor = max((g for g in groups if len(g) > 1), key=lambda g: sum(costs[i] for i in g))
        donor.sort(key=lambda i: (costs[i], i))
        empty.append(donor.pop(0))
    return groups


def plan_packed(
    lengths: Sequence[int], dp: int, max_tokens: int, count_multiple: int = 1
) -> list[list[list[int]]]:
    """Packed micro-batches for every DP rank: `plans[rank]` lists its micro-batches' sequence
    indices, the same number on every rank (a multiple of `count_multiple`), each within
    `max_tokens` (the lengths are the sequences' padded lengths).

    The fewest micro-batches that fit: the sequences are split into dp x M groups of nearly equal
    token counts (Karmarkar-Karp), and the groups dealt to ranks largest first, in alternating
    order, so every rank gets M groups and nearly the same number of tokens.
    """
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens (with padding) does not fit "
            f"engine.max_tokens_per_microbatch={max_tokens}"
        )
    count = max(1, math.ceil(sum(lengths) / (dp * max_tokens)))
    count = padded_length(count, count_multiple)
    while True:
        if dp * count > len(lengths):
            raise ValueError(
                f"{len(lengths)} sequences cannot fill {count} micro-batch(es) on each of {dp} "
                "data-parallel ranks" + _pipeline_note(count_multiple)
            )
        groups = karmarkar_karp(lengths, dp * count)
        if max(sum(lengths[i] for i in g) for g in groups) <= max_tokens:
            break
        count += count_multiple
    groups.sort(key=lambda g: (-sum(lengths[i] for i in g), min(g)))
    plans: list[list[list[int]]] = [[] for _ in range(dp)]
    for round_start in range(0, len(groups), dp):
        ranks = range(dp) if (round_start // dp) % 2 == 0 else reversed(range(dp))
        for rank, group in zip(ranks, groups[round_start : round_start + dp], strict=True):
            plans[rank].append(sorted(group))
    return plans


def plan_padded(
    lengths: Sequence[int], dp: int, max_tokens: int, multiple: int, count_multiple: int = 1
) -> list[list[list[int]]]:
    """Padded micro-batches for every DP rank (see plan_packed), the same number on every rank.

    Sequences go to ranks by greedy token balance (`split_for_data_parallel`) and into padded
    micro-batches by `plan_microbatches`; a rank with fewer micro-batches splits its largest.
    """
    plans = []
    for rank in range(dp):
        mine = split_for_data_parallel(lengths, dp, rank)
        if not mine:
            raise ValueError(
                f"{len(lengths)} sequences cannot feed {dp} data-parallel ranks: each optimizer "
                "step needs at least one sequence per data-parallel rank"
            )
        groups = plan_microbatches([lengths[i] for i in mine], max_tokens, multiple)
        plans.append([[mine[j] for j in g] for g in groups])
    count = padded_length(max(len(p) for p in plans), count_multiple)
    for plan in plans:
        while len(plan) < count:
            largest = max(range(len(plan)), key=lambda i: len(plan[i]))
            if len(plan[largest]) < 2:
                raise ValueError(
                    f"every data-parallel rank needs {count} micro-batch(es)"
                    + _pipeline_note(count_multiple)
                    + f"; one has only {sum(len(g) for g in plan)} sequence(s)"
                )
            group = plan.pop(largest)
            half = len(group) // 2
            plan[largest:largest] = [group[:half], group[half:]]
    return plans


def _pipeline_note(count_multiple: int) -> str:
    if count_multiple == 1:
        return ""
    return f" (a multiple of parallel.pp={count_multiple} for the interleaved pipeline)"


def build_microbatch(
    samples: Sequence[TrainSample],
    indices: Sequence[int],
    *,
    multiple: int,
    pad_id: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    token_advantages: bool = False,
    packed: bool = False,
) -> MicroBatch:
    """The micro-batch of `samples[indices]` for this CP rank.

    multiple: the length (padded: of each row; packed: of the row) is a multiple of it.
    packed: sequences end to end, each padded to a multiple of 2*cp (under CP), the last one
    further so that the total is a multiple of `multiple`.
    """
    chosen = [samples[i] for i in indices]
    b = len(chosen)
    if packed:
        seq_multiple = 2 * cp_size if cp_size > 1 else 1
        seq_lengths = [padded_length(s.length, seq_multiple) for s in chosen]
        seq_lengths[-1] += padded_length(sum(seq_lengths), multiple) - sum(seq_lengths)
    else:
        seq_lengths = [padded_length(max(s.length for s in chosen), multiple)] * b
    full = _padded_rows(chosen, max(seq_lengths), pad_id, token_advantages)
    # This CP rank's positions of every sequence, and where they land in the packed row.
    local = [cp_index(n, cp_size, cp_rank) if cp_size > 1 else torch.arange(n) for n in seq_lengths]
    row_len = max(len(x) for x in local)
    # Every kept token as (sequence, position in it, column in its row), in packed order.
    rows = torch.cat([torch.full((len(x),), row) for row, x in enumerate(local)])
    positions = torch.cat(local)
    columns = torch.cat([torch.arange(len(x)) for x in local])

    def to_rows(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.dim() < 2:
            return t
        out = t.new_zeros((b, row_len) + tuple(t.shape[2:]))
        out[rows, columns] = t[rows, positions]
        return out

    def to_model(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not packed:
            return to_rows(t)
        return t[rows, positions][None]

    row_index = cu_seqlens = None
    if packed:
        starts = torch.tensor([0] + [len(x) for x in local]).cumsum(0)
        total = int(starts[-1])
        column = torch.arange(row_len)
        row_index = torch.where(
            column[None, :] < torch.tensor([len(x) for x in local])[:, None],
            starts[:-1, None] + column[None, :],
            total,
        )
        cu_seqlens = torch.tensor([0] + seq_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return MicroBatch(
        indices=list(indices),
        tokens=to_model(full["tokens"]),
        position_ids=to_model(full["position_ids"]),
        labels=to_model(full["labels"]),
        has_label=to_model(full["has_label"]),
        loss_mask=to_rows(full["loss_mask"]),
        advantages=to_rows(full["advantages"]),
        seq_lengths=torch.tensor(seq_lengths),
        row_index=row_index,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(seq_lengths) if packed else 0,
        old_logprobs=to_rows(full["old_logprobs"]),
        ref_logprobs=to_rows(full["ref_logprobs"]),
        is_weights=to_rows(full["is_weights"]),
        old_values=to_rows(full["old_values"]),
        returns=to_rows(full["returns"]),
        routed_experts=to_model(full["routed_experts"]),
        version_lags=to_rows(full["version_lags"]),
    )


def _padded_rows(
    chosen: Sequence[TrainSample], seq_len: int, pad_id: int, token_advantages: bool
) -> dict[str, torch.Tensor | None]:
    """Every field as [b, seq_len] right-padded rows (per-sequence values as [b])."""
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
    sequence_weights = _sequence_weights(chosen)
    return {
        "tokens": tokens,
        "position_ids": torch.arange(seq_len).expand(b, seq_len).contiguous(),
        "labels": labels,
        "has_label": has_label,
        "loss_mask": loss_mask,
        "advantages": adv,
        "old_logprobs": aligned("old_logprobs"),
        "ref_logprobs": aligned("ref_logprobs"),
        "is_weights": sequence_weights if sequence_weights is not None else aligned("is_weights"),
        "old_values": aligned("old_values"),
        "returns": aligned("returns"),
        "routed_experts": routed,
        "version_lags": aligned("version_lags"),
    }


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


def assemble_cp_rows(parts: Sequence[torch.Tensor], seq_lengths: Sequence[int]) -> torch.Tensor:
    """Every CP rank's row layout ([b, s_row, ...], rank order) -> [b, max length, ...] in
    sequence order."""
    cp = len(parts)
    first = parts[0]
    out = first.new_zeros((first.shape[0], max(seq_lengths)) + tuple(first.shape[2:]))
    for row, length in enumerate(seq_lengths):
        local = length // cp
        for rank, part in enumerate(parts):
            positions = cp_index(length, cp, rank, first.device) if cp > 1 else slice(0, length)
            out[row, positions] = part[row, :local]
    return out
