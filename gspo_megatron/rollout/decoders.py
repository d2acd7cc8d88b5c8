"""The model forwards behind the embedded engine: megatron's own, and a lean one for one rank.

Both hold a KV cache for a batch of rows that share cache slots, run a chunk of tokens at a
slot offset and return the logits of the last fed position (plus the routed experts when asked).

* `MegatronDecoder`: `GPTModel.forward` with megatron's `StaticInferenceContext`. Works on every
  layout the embedded engine accepts (TP with or without SP, EP, ETP, DP), but every row must
  start at slot 0 (megatron's static cache gives all rows the same positions and its local
  attention takes no padding mask), and megatron's per-module overhead costs ~3.5 ms per decode
  step on CPU even for a two-layer model.
* `TorchDecoder`: the same Qwen3 / Qwen3-MoE math written as a flat sequence of torch ops that
  read the trainer's parameter tensors in place (no copy; the optimizer's in-place updates are
  seen by the next batch). Rows may start at different slots (left padding): RoPE positions are
  per row and padding slots are masked out as keys. Keys are cached after RoPE, grouped-query
  attention runs without repeating K/V, experts run on token-sorted slices. Used when the model
  is not split (tp = ep = etp = 1) and has the local-spec Qwen3(-MoE) structure;
  `check_against` compares it with `GPTModel.forward` before it is trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from gspo_megatron.device import accelerator


class MegatronDecoder:
    """`GPTModel.forward` with a static KV cache (megatron's inference context)."""

    name = "megatron"
    left_pad = False  # megatron's static cache gives every row the same positions

    def __init__(self, model, vocab_size: int, routes=None) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.routes = routes  # RouteRecorder in record mode, or None
        self.context: StaticInferenceContext | None = None

    def start(self, starts: torch.Tensor, total: int) -> None:
        """A cache for len(starts) rows of `total` slots; every row starts at slot 0 here."""
        if bool(starts.any()):
            raise ValueError("MegatronDecoder needs every row to start at slot 0")
        self.context = StaticInferenceContext(len(starts), total)

    def forward(self, tokens: torch.Tensor, offset: int):
        """tokens [b, s] at positions offset..; -> (float32 logits [b, vocab], routes or None).

        routes: int [b, s, layers, top_k] when recording.
        """
        rows, length = tokens.shape
        self.context.sequence_len_offset = offset
        positions = torch.arange(offset, offset + length, device=tokens.device)
        positions = positions.expand(rows, length)
        logits = self.model(
            tokens, positions, None, inference_context=self.context, runtime_gather_output=True
        )
        routes = None
        if self.routes is not None:
            # each router saw the tokens in [s, b] order
            per_layer = [
                replay.recorded_topk_idx.reshape(length, rows, -1)
                for _, replay in self.routes.routers[None]
            ]
            routes = torch.stack(per_layer, dim=2).transpose(0, 1)
        return logits[:, -1, : self.vocab_size].float(), routes

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / duplicate cache rows: row i becomes old row index[i]."""
        memory = self.context.key_value_memory_dict
        for layer, (key, value) in memory.items():
            memory[layer] = (key[:, index], value[:, index])
        self.context.max_batch_size = int(index.numel())

    def dummy_forward(self) -> None:
        """One token through the model without cache (keeps MoE collectives in step)."""
        one = torch.zeros(1, 1, dtype=torch.long, device=accelerator())
        self.model(one, one, None, runtime_gather_output=True)


def torch_decoder_unsupported(model, config) -> str | None:
    """Why `TorchDecoder` cannot run this model chunk, or None when it can."""
    if config.tensor_model_parallel_size != 1 or config.expert_model_parallel_size != 1:
        return "the model is split over ranks (tensor or expert parallelism)"
    if (config.expert_tensor_parallel_size or 1) != 1:
        return "expert tensor parallelism"
    checks = {
        "normalization RMSNorm": config.normalization == "RMSNorm",
        "SwiGLU": config.gated_linear_unit and config.activation_func is F.silu,
        "no bias": not config.add_bias_linear,
        "plain RoPE": getattr(model, "position_embedding_type", None) == "rope"
        and not config.rotary_interleaved
        and not config.multi_latent_attention,
        "no MTP": not config.mtp_num_layers,
        "no muP": not getattr(config, "use_mup", False),
        "no attention output gate": not config.attention_output_gate,
        "plain GLU": not config.glu_linear_offset and config.activation_func_clamp_value is None,
        "pre and post process": model.pre_process and model.post_process,
        "torch RMSNorm final norm": isinstance(
            getattr(model.decoder, "final_layernorm", None), torch.nn.RMSNorm
        ),
    }
    if config.num_moe_experts:
        checks.update(
            {
                "softmax router": config.moe_router_score_function == "softmax",
                "plain top-k": not config.moe_router_num_groups
                and not config.moe_router_topk_scaling_factor
                and not config.moe_router_enable_expert_bias
                and not config.moe_apply_probs_on_input
                and config.moe_input_jitter_eps is None,
                "no shared experts": not config.moe_shared_expert_intermediate_size,
            }
        )
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        return "unsupported model features: " + ", ".join(failed)
    for layer in model.decoder.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoELayer):
            if not isinstance(mlp.experts, SequentialMLP):
                return f"expert implementation {type(mlp.experts).__name__}"
        elif not isinstance(mlp, MLP):
            return f"MLP implementation {type(mlp).__name__}"
        attention = layer.self_attention
        if (
            not hasattr(attention, "linear_qkv")
            or getattr(attention.linear_qkv, "bias", None) is not None
        ):
            return "attention layout (fused QKV without bias expected)"
        if not isinstance(layer.pre_mlp_layernorm, torch.nn.RMSNorm) or not isinstance(
            layer.input_layernorm, torch.nn.RMSNorm
        ):
            return "layer norms (separate RMSNorm modules expected)"
        q_norm, k_norm = attention.q_layernorm, attention.k_layernorm
        if isinstance(q_norm, IdentityOp) != isinstance(k_norm, IdentityOp) or (
            not isinstance(q_norm, IdentityOp) and q_norm.eps != k_norm.eps
        ):
            return "query and key norms differ"
    return None


@dataclass
class _Layer:
    """One decoder layer's tensors, bound for a batch (views of the trainer's parameters)."""

    norm_in: tuple[torch.Tensor, float]
    qkv_t: torch.Tensor  # [H, (heads + 2 * groups) * d]
    qk_norm: tuple[torch.Tensor, float] | None  # weights stacked [q_per_group + 1, d]
    proj_t: torch.Tensor
    norm_mlp: tuple[torch.Tensor, float]
    router_t: torch.Tensor | None  # [H, E] in the router dtype; None for a dense MLP
    mlps: list[tuple[torch.Tensor, torch.Tensor]]  # (fc1^T, fc2^T) per expert, or the MLP's


class TorchDecoder:
    """Qwen3(-MoE) forward in plain torch ops over the trainer's parameters (one rank)."""

    name = "torch"
    left_pad = True  # per-row positions and padding masks: prompts end at the same slot

    def __init__(self, model, config, vocab_size: int, record_routes: bool = False) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.record_routes = record_routes
        self.heads = config.num_attention_heads
        self.groups = config.num_query_groups or config.num_attention_heads
        self.per_group = self.heads // self.groups
        self.head_dim = config.kv_channels
        self.topk = config.moe_router_topk or 0
        self.pre_softmax = bool(config.moe_router_pre_softmax)
        dtypes = {"fp32": torch.float32, "fp64": torch.float64}
        self.router_dtype = dtypes.get(config.moe_router_dtype)
        self.layers: list[_Layer] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.starts = torch.zeros(0, dtype=torch.long)

    # -- per batch ------------------------------------------------------------------------------

    def start(self, starts: torch.Tensor, total: int) -> None:
        """A cache for len(starts) rows of `total` slots; row b's tokens begin at starts[b]."""
        self._bind()
        dtype, device = self.embedding.dtype, accelerator()
        shape = (len(starts), self.groups, total, self.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.starts = starts.to(device=device, copy=True)
        emb = self.model.rotary_pos_emb.get_emb(total)[:, 0, 0, :].to(device)  # [total, d] fp32
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

    def _bind(self) -> None:
        model = self.model
        self.embedding = model.embedding.word_embeddings.weight
        out = (
            model.shared_embedding_or_output_weight()
            if model.share_embeddings_and_output_weights
            else model.output_layer.weight
        )
        self.output_t = out[: self.vocab_size].t()
        final = model.decoder.final_layernorm
        self.final_norm = (final.weight, final.eps)
        self.layers = []
        for layer in model.decoder.layers:
            attn = layer.self_attention
            qk_norm = None
            if not isinstance(attn.q_layernorm, IdentityOp):
                q, k = attn.q_layernorm, attn.k_layernorm
                weight = torch.cat([q.weight.expand(self.per_group, -1), k.weight[None]])
                qk_norm = (weight, q.eps)
            mlp = layer.mlp
            if isinstance(mlp, MoELayer):
                dtype = self.router_dtype or mlp.router.weight.dtype
                router_t = mlp.router.weight.to(dtype).t()
                experts = mlp.experts.local_experts
            else:
                router_t, experts = None, [mlp]
            self.layers.append(
                _Layer(
                    norm_in=(layer.input_layernorm.weight, layer.input_layernorm.eps),
                    qkv_t=attn.linear_qkv.weight.t(),
                    qk_norm=qk_norm,
                    proj_t=attn.linear_proj.weight.t(),
                    norm_mlp=(layer.pre_mlp_layernorm.weight, layer.pre_mlp_layernorm.eps),
                    router_t=router_t,
                    mlps=[(e.linear_fc1.weight.t(), e.linear_fc2.weight.t()) for e in experts],
                )
            )
        scale = getattr(
            model.decoder.layers[0].self_attention.core_attention, "softmax_scale", None
        )
        self.scale = scale or 1.0 / math.sqrt(self.head_dim)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / duplicate cache rows: row i becomes old row index[i]."""
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]
        self.starts = self.starts[index]
        self.cos_rows = self.cos_rows[index]
        self.sin_rows = self.sin_rows[index]
        self.key_bias = self.key_bias[index]

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

    def _attention(self, layer: _Layer, x, index: int, offset: int, cos, sin, mask):
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

    def _moe(self, layer: _Layer, x: torch.Tensor):
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


def check_against(fast: TorchDecoder, reference: MegatronDecoder, vocab_size: int) -> float:
    """Max |log-prob difference| of the two decoders on a prefill + two decode steps."""
    gen = torch.Generator().manual_seed(0)
    device = accelerator()
    tokens = torch.randint(0, vocab_size, (3, 9), generator=gen).to(device)
    worst = 0.0
    for decoder in (fast, reference):
        decoder.start(torch.zeros(3, dtype=torch.long, device=device), 9)
    results = []
    for decoder in (fast, reference):
        out = [decoder.forward(tokens[:, :7], 0)[0]]
        out += [decoder.forward(tokens[:, t : t + 1], t)[0] for t in (7, 8)]
        results.append(out)
    for a, b in zip(*results, strict=True):
        diff = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max()
        worst = max(worst, float(diff))
    return worst
