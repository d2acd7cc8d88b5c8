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
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
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
    # Packed without CP: how attention runs the sequences as padded rows (attention_buckets):
    # for each bucket of similar lengths, (rows, row length); `attention_index` lists, bucket
    # after bucket and row after row, the packed token of every slot (0 for the slots past a
    # sequence's end); `attention_inverse` [T] each packed token's slot.
    attention_shapes: list[tuple[int, int]] = field(default_factory=list)
    attention_index: torch.Tensor | None = None
    attention_inverse: torch.Tensor | None = None

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
        """A copy with `fn` applied to every tensor (this one when `fn` returns each as it is:
        moving to the device it is on, pinning on a machine without a GPU)."""
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                new = fn(value)
                if new is not value:
                    changes[f.name] = new
        return replace(self, **changes) if changes else self

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
    if parts == 1:
        return [list(range(len(costs)))]
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

    Every field is first laid out as right-padded [b, s] rows (`_padded_rows`, one vectorised
    fill per field), then this rank's tokens are picked from them for each layout.
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
    # This CP rank's positions of every sequence, and where they land in its row.
    local_lengths = np.array(seq_lengths) // cp_size
    row_len = int(local_lengths.max())
    starts = np.concatenate([[0], np.cumsum(local_lengths)])
    # Without CP the row layout is the padded rows themselves, packed too: each row is as wide
    # as the longest padded sequence, and every row-layout field is 0 past its response; and the
    # packed row is the padded rows' tokens inside each sequence, in order (`inside` picks them).
    whole_rows = cp_size == 1
    if not whole_rows:
        # Every kept token as (sequence, position in it, column in its row), in packed order.
        rows = np.repeat(np.arange(b), local_lengths)
        columns = np.arange(int(starts[-1])) - np.repeat(starts[:-1], local_lengths)
        positions = np.concatenate([_cp_positions(n, cp_size, cp_rank) for n in seq_lengths])
    inside = np.arange(row_len)[None, :] < local_lengths[:, None]

    def to_rows(t: np.ndarray | None) -> torch.Tensor | None:
        if t is None:
            return None
        if t.ndim < 2 or whole_rows:
            return torch.from_numpy(t)
        out = np.zeros((b, row_len) + t.shape[2:], dtype=t.dtype)
        out[rows, columns] = t[rows, positions]
        return torch.from_numpy(out)

    def to_model(t: np.ndarray | None) -> torch.Tensor | None:
        if t is None or not packed:
            return to_rows(t)
        return torch.from_numpy((t[inside] if whole_rows else t[rows, positions])[None])

    row_index = cu_seqlens = None
    if packed:
        total = int(starts[-1])
        row_index = torch.from_numpy(
            np.where(inside, starts[:-1, None] + np.arange(row_len), total)
        )
        cu_seqlens = torch.from_numpy(np.cumsum([0] + seq_lengths, dtype=np.int32))
    attention = _AttentionRows([], None, None)
    if packed and cp_size == 1:
        attention = _attention_rows(seq_lengths)
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
        attention_shapes=attention.shapes,
        attention_index=attention.index,
        attention_inverse=attention.inverse,
    )


# One call of the attention kernel costs about as much as this many query-key pairs of its
# arithmetic (measured on CPU with the tiny models' heads: ~0.05 ms a call, 15-60 ns a pair):
# sequences of different lengths share a padded call while their padding costs less.
ATTENTION_CALL_PAIRS = 64 * 64


def attention_buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Sequences (indices of `lengths`) grouped for attention as padded rows, one kernel call
    per group, longest first: of the splits of the sequences sorted by length, the one with the
    least Σ over groups of (rows x longest² + ATTENTION_CALL_PAIRS). Uniform lengths make one
    group (the padded layout's single call), long tails one per band of similar lengths."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    # Splitting equal lengths never pays, so groups are runs of distinct lengths (longest
    # first). Every cost is a whole number well below 2**53: Python ints, exact.
    distinct: list[int] = []
    before = [0]  # sequences before each distinct length
    for i in order:
        if not distinct or lengths[i] != distinct[-1]:
            distinct.append(lengths[i])
            before.append(before[-1])
        before[-1] += 1
    cost = [0] * (len(distinct) + 1)
    start = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        # the last group holds distinct lengths i..j-1, padded to distinct[i]; the first
        # cheapest i
        best = min(
            range(j),
            key=lambda i: cost[i] + (before[j] - before[i]) * distinct[i] ** 2,
        )
        start[j] = best
        cost[j] = cost[best] + (before[j] - before[best]) * distinct[best] ** 2
        cost[j] += ATTENTION_CALL_PAIRS
    groups, j = [], len(distinct)
    while j > 0:
        groups.append(order[before[start[j]] : before[j]])
        j = start[j]
    return groups[::-1]


@dataclass
class _AttentionRows:
    shapes: list[tuple[int, int]]
    index: torch.Tensor | None
    inverse: torch.Tensor | None


def _attention_rows(seq_lengths: Sequence[int]) -> _AttentionRows:
    """The micro-batch's attention_shapes / attention_index / attention_inverse."""
    starts = np.concatenate([[0], np.cumsum(seq_lengths)])
    total = int(starts[-1])
    shapes, index, inverse = [], [], np.empty(total, dtype=np.int64)
    offset = 0
    for group in attention_buckets(seq_lengths):
        lengths = np.array([seq_lengths[i] for i in group])
        width = int(lengths.max())
        column = np.arange(width)
        real = column[None, :] < lengths[:, None]
        tokens = starts[group][:, None] + column[None, :]
        index.append(np.where(real, tokens, 0).reshape(-1))
        inverse[tokens[real]] = offset + np.flatnonzero(real.reshape(-1))
        shapes.append((len(group), width))
        offset += len(group) * width
    return _AttentionRows(
        shapes, torch.from_numpy(np.concatenate(index)), torch.from_numpy(inverse)
    )


def denominator_of(samples: Sequence[TrainSample], per_token: bool) -> int:
    """`denominator_count` of the samples' response mask (each loss mask as float32, 1 where
    none is given), counted without building it: the response tokens whose mask is nonzero
    (`per_token`), else the samples with at least one."""
    count = 0
    for s in samples:
        if s.loss_mask is None:
            nonzero = len(s.response_ids)
        else:
            nonzero = int(np.count_nonzero(np.asarray(s.loss_mask, dtype=np.float32)))
        count += nonzero if per_token else nonzero > 0
    return count


def _flat_index(row_starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat positions row_starts[i] + 0..counts[i]-1 of every i, concatenated."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.arange(int(counts.sum())) + np.repeat(row_starts - starts, counts)


def _floats(values: Sequence[Sequence[float]], count: int) -> np.ndarray:
    """Concatenated lists of floats as float32 (each rounded as torch.tensor(float32) does)."""
    return np.fromiter(itertools.chain.from_iterable(values), dtype=np.float32, count=count)


def _padded_rows(
    chosen: Sequence[TrainSample], seq_len: int, pad_id: int, token_advantages: bool
) -> dict[str, np.ndarray | None]:
    """Every field as [b, seq_len] right-padded rows (per-sequence values as [b])."""
    b = len(chosen)
    lengths = np.array([s.length for s in chosen])
    prompt_lengths = np.array([len(s.prompt_ids) for s in chosen])
    response_lengths = lengths - prompt_lengths
    row_starts = np.arange(b) * seq_len
    # Label-aligned response positions: row r, columns prompt_len-1 .. len-2.
    response = _flat_index(row_starts + prompt_lengths - 1, response_lengths)
    n_response = int(response_lengths.sum())

    tokens = np.full(b * seq_len, pad_id, dtype=np.int64)
    tokens[_flat_index(row_starts, lengths)] = np.fromiter(
        itertools.chain.from_iterable(
            itertools.chain(s.prompt_ids, s.response_ids) for s in chosen
        ),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    tokens = tokens.reshape(b, seq_len)
    # Each position's next token; a sequence's last position reads the padding after it.
    labels = np.full((b, seq_len), pad_id, dtype=np.int64)
    labels[:, :-1] = tokens[:, 1:]
    has_label = np.arange(seq_len)[None, :] < (lengths - 1)[:, None]

    def aligned(values: list) -> np.ndarray:
        out = np.zeros(b * seq_len, dtype=np.float32)
        out[response] = _floats(values, n_response)
        return out.reshape(b, seq_len)

    def optional(name: str) -> np.ndarray | None:
        values = [getattr(s, name) for s in chosen]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"{name} is given for some samples of a micro-batch but not all")
        return aligned(values)

    loss_mask = aligned(
        [
            itertools.repeat(1.0, n) if s.loss_mask is None else s.loss_mask
            for s, n in zip(chosen, response_lengths.tolist(), strict=True)
        ]
    )
    if token_advantages:
        advantages = aligned(
            [
                s.advantage if isinstance(s.advantage, list) else itertools.repeat(s.advantage, n)
                for s, n in zip(chosen, response_lengths.tolist(), strict=True)
            ]
        )
    else:
        if any(isinstance(s.advantage, list) for s in chosen):
            raise ValueError("token-level advantages given to a sequence-level loss")
        advantages = np.array([float(s.advantage) for s in chosen], dtype=np.float32)
    sequence_weights = _sequence_weights(chosen)
    return {
        "tokens": tokens,
        "position_ids": np.broadcast_to(np.arange(seq_len), (b, seq_len)).copy(),
        "labels": labels,
        "has_label": has_label,
        "loss_mask": loss_mask,
        "advantages": advantages,
        "old_logprobs": optional("old_logprobs"),
        "ref_logprobs": optional("ref_logprobs"),
        "is_weights": sequence_weights if sequence_weights is not None else optional("is_weights"),
        "old_values": optional("old_values"),
        "returns": optional("returns"),
        "routed_experts": _padded_routes(chosen, seq_len, row_starts),
        "version_lags": optional("version_lags"),
    }


def _padded_routes(
    chosen: Sequence[TrainSample], seq_len: int, row_starts: np.ndarray
) -> np.ndarray | None:
    """Routes as [b, seq_len, layers, top_k] int32; positions without a recorded route (padding,
    the last token) get the experts 0..k-1: a valid, duplicate-free choice whose outputs are
    never used."""
    routes = [s.routed_experts for s in chosen]
    if all(r is None for r in routes):
        return None
    if any(r is None for r in routes):
        raise ValueError("routed experts are given for some samples but not all")
    routes = [np.asarray(r) for r in routes]
    per_token = routes[0].shape[1:]
    out = np.broadcast_to(
        np.arange(per_token[-1], dtype=np.int32), (len(chosen) * seq_len,) + per_token
    ).copy()
    counts = np.array([r.shape[0] for r in routes])
    out[_flat_index(row_starts, counts)] = np.concatenate(routes).astype(np.int32)
    return out.reshape((len(chosen), seq_len) + per_token)


def _sequence_weights(chosen: Sequence[TrainSample]) -> np.ndarray | None:
    """[b] when the samples carry one importance weight each, else None (token weights or none)."""
    per_sequence = [isinstance(s.is_weights, int | float) for s in chosen]
    if not any(per_sequence):
        return None
    if not all(per_sequence):
        raise ValueError("is_weights are one per sequence for some samples of a micro-batch only")
    return np.array([float(s.is_weights) for s in chosen], dtype=np.float32)


def _cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """`cp_index` on the host, as a numpy array."""
    chunk = seq_len // (2 * cp_size)
    last = 2 * cp_size - 1 - cp_rank
    return np.concatenate(
        [
            np.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
            np.arange(last * chunk, (last + 1) * chunk),
        ]
    )


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
