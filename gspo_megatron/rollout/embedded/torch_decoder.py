"""The Qwen3 / Qwen3-MoE forward as a flat sequence of torch ops, with a KV cache (no megatron).

`TorchDecoder` runs the model for the embedded engine (bound to the trainer's megatron parameters
in place, rollout/embedded/decoders.py) and for the asynchronous generator process (bound
to its own copy of the Hugging Face-named weights, `hf_decoder_weights`). Rows may start at
different slots (left padding): RoPE positions are per row and padding slots are masked out as
keys. Keys are cached after RoPE, grouped-query attention runs without repeating K/V, experts
run on token-sorted slices. `decoders.check_against` compares it with `GPTModel.forward` before
the embedded engine trusts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gspo_megatron.checkpoint.mapping import qkv_to_megatron

if TYPE_CHECKING:
    from gspo_megatron.spec.model_config import ModelConfig


@dataclass(frozen=True)
class DecoderSpec:
    """The shape facts the forward needs (picklable: the generator process gets a copy)."""

    heads: int
    groups: int  # key/value heads
    head_dim: int
    topk: int  # experts per token; 0 for a dense model
    pre_softmax: bool  # softmax over all experts before top-k (else over the top-k logits)
    router_dtype: torch.dtype | None  # None: the router weight's own dtype
    vocab_size: int  # logits beyond it (padding rows) are never produced
    scale: float  # attention softmax scale

    @property
    def per_group(self) -> int:
        return self.heads // self.groups


@dataclass
class DecoderLayer:
    """One decoder layer's tensors (views of the bound weights)."""

    norm_in: tuple[torch.Tensor, float]
    qkv_t: torch.Tensor  # [H, (heads + 2 * groups) * d], megatron's per-group row order
    qk_norm: tuple[torch.Tensor, float] | None  # weights stacked [q_per_group + 1, d]
    proj_t: torch.Tensor
    norm_mlp: tuple[torch.Tensor, float]
    router_t: torch.Tensor | None  # [H, E] in the router dtype; None for a dense MLP
    mlps: list[tuple[torch.Tensor, torch.Tensor]]  # (fc1^T, fc2^T) per expert, or the MLP's


@dataclass
class DecoderWeights:
    """Every tensor one batch reads."""

    embedding: torch.Tensor  # [padded vocab, H]
    output_t: torch.Tensor  # [H, vocab_size]
    final_norm: tuple[torch.Tensor, float]
    layers: list[DecoderLayer]
    rope: Callable[[int], torch.Tensor]  # total slots -> RoPE angles [total, d], float32


def qk_norm_weights(q: torch.Tensor, k: torch.Tensor, per_group: int) -> torch.Tensor:
    """Query and key norm weights stacked as the forward applies them to [q heads of a group; k]."""
    return torch.cat([q.expand(per_group, -1), k[None]])


class TorchDecoder:
    """Qwen3(-MoE) forward in plain torch ops over weights that `bind` returns at each batch."""

    name = "torch"
    left_pad = True  # per-row positions and padding masks: prompts end at the same slot
    keeps_context = True  # rows' K/V can be read out and written back (prefix_cache.py)

    def __init__(
        self,
        spec: DecoderSpec,
        bind: Callable[[], DecoderWeights],
        record_routes: bool = False,
    ) -> None:
        self.spec = spec
        self.bind = bind
        self.vocab_size = spec.vocab_size
        self.record_routes = record_routes
        self.heads, self.groups, self.per_group = spec.heads, spec.groups, spec.per_group
        self.head_dim, self.topk, self.scale = spec.head_dim, spec.topk, spec.scale
        self.pre_softmax = spec.pre_softmax
        self.layers: list[DecoderLayer] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.starts = torch.zeros(0, dtype=torch.long)

    # -- per batch ------------------------------------------------------------------------------

    def start(self, starts: torch.Tensor, total: int) -> None:
        """A cache for len(starts) rows of `total` slots; row b's tokens begin at starts[b]."""
        weights = self.bind()
        self.embedding, self.output_t = weights.embedding, weights.output_t
        self.final_norm, self.layers = weights.final_norm, weights.layers
        # the cache lives with the weights (the trainer's device, or the generator process's)
        dtype, device = self.embedding.dtype, self.embedding.device
        shape = (len(starts), self.groups, total, self.head_dim)
        # zeros: a prefill after a kept context (offset > 0) leaves padding slots unwritten, and
        # masked keys still meet their values in the product (0 * a stray NaN is NaN)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.starts = starts.to(device=device, copy=True)
        emb = weights.rope(total).to(device)  # [total, d] fp32
        half = emb.shape[-1] // 2
        sin = torch.sin(emb)
        # rotate_half(x) * sin == x.roll(d/2) * (sin with its first half negated)
        sin[:, :half].neg_()
        slots = torch.arange(total, device=device)
        positions = (slots[None, :] - self.starts[:, None]).clamp_(min=0)
        self.cos_rows = torch.cos(emb).to(dtype)[positions]  # [b, total, d]
        self.sin_rows = sin.to(dtype)[positions]
        self.padded = bool(self.starts.any())
        # additive key mask for decoding: -inf on a row's padding slots
        self.key_bias = torch.zeros(len(starts), total, dtype=dtype, device=device)
        self.key_bias.masked_fill_(slots[None, :] < self.starts[:, None], -math.inf)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / duplicate cache rows: row i becomes old row index[i]."""
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]
        self.starts = self.starts[index]
        self.cos_rows = self.cos_rows[index]
        self.sin_rows = self.sin_rows[index]
        self.key_bias = self.key_bias[index]

    def read_context(
        self, row: int, start: int, length: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row `row`'s keys and values at slots start .. start+length, per layer
        [kv heads, length, head dim] (keys after RoPE at positions 0 .. length-1)."""
        end = start + length
        keys = [k[row, :, start:end].clone() for k in self.keys]
        return keys, [v[row, :, start:end].clone() for v in self.values]

    def write_context(
        self, row: int, start: int, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> None:
        """Put `read_context`'s keys and values into row `row` from slot `start` (the row's
        first slot: the positions they were rotated with)."""
        end = start + keys[0].shape[1]
        for cache, kept in zip(self.keys, keys, strict=True):
            cache[row, :, start:end] = kept
        for cache, kept in zip(self.values, values, strict=True):
            cache[row, :, start:end] = kept

    # -- forward --------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, offset: int):
        """tokens [b, s] at slots offset..; -> (float32 logits [b, vocab], routes or None)."""
        rows, length = tokens.shape
        end = offset + length
        h = F.embedding(tokens, self.embedding)  # [b, s, H]
        cos = self.cos_rows[:, offset:end, None, None, :]  # [b, s, 1, 1, d]
        sin = self.sin_rows[:, offset:end, None, None, :]
        if length == 1:
            mask = self.key_bias[:, None, None, :end] if self.padded else None  # [b, 1, 1, t]
        else:
            mask = self._prefill_mask(offset, end)
        routes = [] if self.record_routes else None
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(h, (h.shape[-1],), *layer.norm_in)
            h = h + self._attention(layer, x, index, offset, cos, sin, mask)
            x = F.rms_norm(h, (h.shape[-1],), *layer.norm_mlp)
            if layer.router_t is not None:
                out, chosen = self._moe(layer, x.view(rows * length, -1))
                h = h + out.view_as(h)
                if routes is not None:
                    routes.append(chosen.view(rows, length, -1))
            else:
                h = h + self._mlp(layer.mlps[0], x)
        last = F.rms_norm(h[:, -1], (h.shape[-1],), *self.final_norm)
        logits = last @ self.output_t
        if routes is not None:
            routes = torch.stack(routes, dim=2)
        return logits.float(), routes

    def _prefill_mask(self, offset: int, end: int) -> torch.Tensor | None:
        """bool [b, 1, s, t] (True = attend): causal, and a row's padding slots hidden."""
        if not self.padded and offset == 0:
            return None
        slots = torch.arange(end, device=self.starts.device)
        query = torch.arange(offset, end, device=self.starts.device)
        causal = slots[None, :] <= query[:, None]
        if not self.padded:
            return causal
        visible = (slots[None, :] >= self.starts[:, None])[:, None, :] & causal[None]
        # a padding query attends to itself only, which keeps its (unused) values finite
        return (visible | (slots[None, :] == query[:, None])[None])[:, None]

    def _attention(self, layer: DecoderLayer, x, index: int, offset: int, cos, sin, mask):
        rows, length, _ = x.shape
        groups, per_group, d = self.groups, self.per_group, self.head_dim
        qkv = (x @ layer.qkv_t).view(rows, length, groups, per_group + 2, d)
        qk = qkv[:, :, :, : per_group + 1]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), None, layer.qk_norm[1]) * layer.qk_norm[0]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin  # RoPE on the queries and the key
        q, k = qk[:, :, :, :per_group], qk[:, :, :, per_group]
        end = offset + length
        # a prefill may feed fewer rows than the cache holds (one per distinct prompt)
        keys, values = self.keys[index], self.values[index]
        keys[:rows, :, offset:end] = k.transpose(1, 2)
        values[:rows, :, offset:end] = qkv[:, :, :, per_group + 1].transpose(1, 2)
        keys = keys[:rows, :, :end]  # [b, g, t, d]
        values = values[:rows, :, :end]
        if length == 1:
            # decode: a group's query heads act as the query positions of its K/V head
            scores = torch.matmul(q.view(rows, groups, per_group, d), keys.transpose(2, 3))
            scores = scores.mul_(self.scale)
            if mask is not None:
                scores = scores.add_(mask)
            out = torch.matmul(torch.softmax(scores, dim=-1), values)
            out = out.view(rows, 1, groups * per_group * d)
        else:
            q = q.reshape(rows, length, groups * per_group, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=per_group > 1,
            )
            out = out.transpose(1, 2).reshape(rows, length, -1)
        return out @ layer.proj_t

    @staticmethod
    def _mlp(weights, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        fc1_t, fc2_t = weights
        gate, up = (x @ fc1_t).chunk(2, dim=-1)
        inner = F.silu(gate) * up
        if scale is not None:
            inner = inner * scale[:, None]
        return inner @ fc2_t

    def _moe(self, layer: DecoderLayer, x: torch.Tensor):
        """x [N, H] -> (output [N, H], chosen experts [N, k]); megatron's top-k routing."""
        logits = x.to(layer.router_t.dtype) @ layer.router_t
        if self.pre_softmax:
            probs, chosen = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1, sorted=False)
        else:
            top, chosen = logits.topk(self.topk, dim=-1, sorted=False)
            probs = torch.softmax(top, dim=-1)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(layer.mlps)).tolist()
        token_of = order // self.topk
        inputs = x.index_select(0, token_of).split(counts)
        scales = probs.to(x.dtype).flatten().index_select(0, order).split(counts)
        outputs = [
            self._mlp(weights, part, scale)
            for weights, part, scale, count in zip(layer.mlps, inputs, scales, counts, strict=True)
            if count
        ]
        out = torch.zeros_like(x).index_add_(0, token_of, torch.cat(outputs))
        return out, chosen


def hf_decoder_weights(
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    spec: DecoderSpec,
    rope_table: torch.Tensor,
) -> DecoderWeights:
    """`DecoderWeights` over Hugging Face-named tensors (the names `WeightSource` streams).

    Q, K and V are fused into megatron's per-group row order and gate/up into fc1 once here, so
    a batch reads them like the trainer's. `rope_table` holds the RoPE angles [positions, d]
    (the trainer's own, so both sides rotate identically).
    """
    eps = cfg.rms_norm_eps
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = qkv_to_megatron(
            tensors[p + "self_attn.q_proj.weight"],
            tensors[p + "self_attn.k_proj.weight"],
            tensors[p + "self_attn.v_proj.weight"],
            cfg,
        )
        qk = qk_norm_weights(
            tensors[p + "self_attn.q_norm.weight"],
            tensors[p + "self_attn.k_norm.weight"],
            spec.per_group,
        )
        router = tensors.get(p + "mlp.gate.weight")
        if router is not None:
            names = [f"{p}mlp.experts.{e}." for e in range(cfg.num_experts)]
            router_t = router.to(spec.router_dtype or router.dtype).t()
        else:
            names, router_t = [p + "mlp."], None
        mlps = [
            (
                torch.cat([tensors[n + "gate_proj.weight"], tensors[n + "up_proj.weight"]]).t(),
                tensors[n + "down_proj.weight"].t(),
            )
            for n in names
        ]
        layers.append(
            DecoderLayer(
                norm_in=(tensors[p + "input_layernorm.weight"], eps),
                qkv_t=qkv.t(),
                qk_norm=(qk, eps),
                proj_t=tensors[p + "self_attn.o_proj.weight"].t(),
                norm_mlp=(tensors[p + "post_attention_layernorm.weight"], eps),
                router_t=router_t,
                mlps=mlps,
            )
        )
    embedding = tensors["model.embed_tokens.weight"]
    output = embedding if cfg.tie_word_embeddings else tensors["lm_head.weight"]
    return DecoderWeights(
        embedding=embedding,
        output_t=output[: spec.vocab_size].t(),
        final_norm=(tensors["model.norm.weight"], eps),
        layers=layers,
        rope=lambda total: rope_table[:total],
    )
