"""Core attention for machines without transformer-engine, with context parallelism.

megatron-core's local `DotProductAttention` refuses context parallelism (only TE's attention
implements it). This module takes its place in the local layer spec: causal attention through
`torch.nn.functional.scaled_dot_product_attention`, and under CP it all-gathers keys and values
over the CP group and masks by the global positions of megatron's load-balanced layout (rank r
holds sequence chunks r and 2*cp-1-r of 2*cp equal chunks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("LocalCoreAttention supports neither packed sequences nor biases")
        # [s, b, heads, d] -> [b, heads, s, d]
        sq, batch, heads, _ = query.shape
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if cp_size > 1:
            cp_rank = dist.get_rank(self.cp_group)
            key = _GatherSequence.apply(key, self.cp_group)
            value = _GatherSequence.apply(value, self.cp_group)
            q_pos = cp_chunk_positions(sq, cp_rank, cp_size, query.device)
            k_pos = torch.cat(
                [cp_chunk_positions(sq, r, cp_size, query.device) for r in range(cp_size)]
            )
            mask = k_pos[None, :] <= q_pos[:, None]
        elif key.shape[0] != sq:
            # Decoding with a KV cache: the queries are the last sq of sk positions.
            offset = key.shape[0] - sq
            q_pos = torch.arange(sq, device=query.device) + offset
            mask = torch.arange(key.shape[0], device=query.device)[None, :] <= q_pos[:, None]
        else:
            mask = None
        groups = key.shape[2]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if heads != groups:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale
        )
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * self.head_dim)
