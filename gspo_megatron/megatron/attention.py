"""Core attention for machines without transformer-engine, with context parallelism.

megatron-core's local `DotProductAttention` refuses context parallelism (only TE's attention
implements it), and packed sequences (THD). This module takes its place in the local layer
spec: causal attention through `torch.nn.functional.scaled_dot_product_attention`; under CP it
all-gathers keys and values over the CP group and masks by the global positions of megatron's
load-balanced layout (rank r holds sequence chunks r and 2*cp-1-r of 2*cp equal chunks, of every
packed sequence separately).

Packed sequences (THD) never attend across a boundary. Without CP, the micro-batch carries a plan
(`PackedRowsParams`, made by batch.build_microbatch): its sequences in buckets of similar
lengths, each bucket gathered into right-padded rows and attended causally in one call with no
mask, which on short sequences costs what the padded layout's single call does. Under CP (or
without a plan) consecutive sequences are attended in groups of at most GROUP_TOKENS tokens
under a block-diagonal causal mask over the global positions (a longer one alone), so no mask
exceeds GROUP_TOKENS^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def cp_chunk_positions(
    local_length: int, cp_rank: int, cp_size: int, device: torch.device
) -> torch.Tensor:
    """Global positions of the tokens a CP rank holds, in its local order."""
    if cp_size == 1:
        return torch.arange(local_length, device=device)
    chunk = local_length // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


@dataclass
class PackedRowsParams(PackedSeqParams):
    """megatron's THD parameters plus the micro-batch's attention plan for LocalCoreAttention
    (batch.MicroBatch.attention_*); transformer-engine reads the THD fields alone."""

    row_shapes: list[tuple[int, int]] = field(default_factory=list)
    row_index: torch.Tensor | None = None
    row_inverse: torch.Tensor | None = None


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward sums gradients and keeps this rank's part.

    Written with all_reduce in the backward because gloo has no reduce_scatter.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        ctx.rank = dist.get_rank(group)
        ctx.length = tensor.shape[0]
        out = tensor.new_empty((world * tensor.shape[0],) + tuple(tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length], None


class LocalCoreAttention(MegatronModule):
    """Drop-in for megatron's core attention in the local (no-TE) spec, CP-capable."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"LocalCoreAttention supports causal masks only, got {attn_mask_type}")
        if config.attention_dropout:
            raise ValueError("LocalCoreAttention has no attention dropout; set it to 0")
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.cp_group = (
            pg_collection.cp
            if pg_collection is not None
            else parallel_state.get_context_parallel_group()
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("LocalCoreAttention does not support attention biases")
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        cp_rank = dist.get_rank(self.cp_group) if cp_size > 1 else 0
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, cp_size, cp_rank)
        # [s, b, heads, d]
        sq = query.shape[0]
        if cp_size > 1:
            key = _GatherSequence.apply(key, self.cp_group)
            value = _GatherSequence.apply(value, self.cp_group)
            mask = _cp_causal_mask(sq, cp_rank, cp_size, query.device)
        elif key.shape[0] != sq:
            # Decoding with a KV cache: the queries are the last sq of sk positions.
            offset = key.shape[0] - sq
            q_pos = torch.arange(sq, device=query.device) + offset
            mask = torch.arange(key.shape[0], device=query.device)[None, :] <= q_pos[:, None]
        else:
            mask = None
        return self._attend(query, key, value, mask)

    def _packed(self, query, key, value, params, cp_size: int, cp_rank: int) -> torch.Tensor:
        """THD: [t, heads, d] with sequences end to end (this CP rank's chunks of each)."""
        if params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {params.qkv_format!r}; expected 'thd'")
        if cp_size == 1 and isinstance(params, PackedRowsParams) and params.row_shapes:
            return self._packed_rows(query, key, value, params)
        boundaries = params.cu_seqlens_q_padded
        if boundaries is None:
            boundaries = params.cu_seqlens_q
        lengths = [n // cp_size for n in (boundaries[1:] - boundaries[:-1]).tolist()]
        if sum(lengths) != query.shape[0]:
            raise ValueError(
                f"packed sequences cover {sum(lengths)} tokens of this rank, the input has "
                f"{query.shape[0]}"
            )
        if cp_size > 1:
            key = _GatherSequence.apply(key, self.cp_group)
            value = _GatherSequence.apply(value, self.cp_group)
        outputs, start = [], 0
        for group in _attention_groups(lengths):
            size = sum(group)
            q = query[start : start + size, None]
            # Rank r's chunks of these sequences sit at the same offset of its part.
            local = query.shape[0]
            k = torch.cat(
                [key[r * local + start : r * local + start + size] for r in range(cp_size)]
            )
            v = torch.cat(
                [value[r * local + start : r * local + start + size] for r in range(cp_size)]
            )
            mask = None
            if cp_size > 1 or len(group) > 1:
                mask = _packed_causal_mask(group, cp_rank, cp_size, query.device)
            outputs.append(self._attend(q, k[:, None], v[:, None], mask))
            start += size
        return torch.cat(outputs)

    def _packed_rows(self, query, key, value, params: PackedRowsParams) -> torch.Tensor:
        """THD [t, heads, d] attended as the plan's buckets of right-padded rows, causally."""
        if params.row_inverse.shape[0] != query.shape[0]:
            raise ValueError(
                f"the attention plan covers {params.row_inverse.shape[0]} tokens, the input has "
                f"{query.shape[0]}"
            )
        # Slots past a sequence's end (a copy of token 0) come after its real tokens: causal
        # attention keeps them from every real query, their outputs are never gathered back,
        # and so the gradient they send to token 0 is exactly zero.
        outputs, offset = [], 0
        for rows, width in params.row_shapes:
            index = params.row_index[offset : offset + rows * width]
            offset += rows * width
            # [rows * width, heads, d] -> [rows, heads, width, d]
            q_b, k_b, v_b = (
                x[index].view((rows, width) + tuple(x.shape[1:])).transpose(1, 2)
                for x in (query, key, value)
            )
            out = self._sdpa(q_b, k_b, v_b, None)
            outputs.append(out.transpose(1, 2).reshape(rows * width, -1))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return out[params.row_inverse]

    def _attend(self, query, key, value, mask) -> torch.Tensor:
        """[s, b, heads, d] queries, [sk, b, groups, d] keys and values -> [s, b, heads * d]."""
        sq, batch, heads, _ = query.shape
        context = self._sdpa(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), mask
        )
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * self.head_dim)

    def _sdpa(self, q, k, v, mask) -> torch.Tensor:
        """[b, heads, s, d] queries, [b, groups, sk, d] keys and values; causal without a mask."""
        heads, groups = q.shape[1], k.shape[1]
        if heads != groups:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale
        )


# Consecutive packed sequences are attended together up to this many tokens (one masked call
# instead of one call per sequence: short sequences cost launches, not arithmetic); a longer
# sequence is attended alone, causally, with no mask.
GROUP_TOKENS = 256


def _attention_groups(lengths: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for length in lengths:
        if groups and sum(groups[-1]) + length <= GROUP_TOKENS:
            groups[-1].append(length)
        else:
            groups.append([length])
    return groups


def _packed_causal_mask(lengths: list[int], cp_rank: int, cp_size: int, device) -> torch.Tensor:
    """[local queries, keys of every rank] for consecutive packed sequences of these local
    lengths: a key is visible to a query of the same sequence at the same or an earlier global
    position."""
    ids = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )

    def positions(rank: int) -> torch.Tensor:
        return torch.cat([cp_chunk_positions(n, rank, cp_size, device) for n in lengths])

    q_pos = positions(cp_rank)
    k_pos = torch.cat([positions(r) for r in range(cp_size)])
    k_ids = ids.repeat(cp_size)
    return (k_ids[None, :] == ids[:, None]) & (k_pos[None, :] <= q_pos[:, None])


def _cp_causal_mask(local_length: int, cp_rank: int, cp_size: int, device) -> torch.Tensor:
    """Causal mask of this rank's queries over every rank's keys (gathered in rank order)."""
    q_pos = cp_chunk_positions(local_length, cp_rank, cp_size, device)
    k_pos = torch.cat(
        [cp_chunk_positions(local_length, r, cp_size, device) for r in range(cp_size)]
    )
    return k_pos[None, :] <= q_pos[:, None]
