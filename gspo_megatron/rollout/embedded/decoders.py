"""The model forwards behind the embedded engine: megatron's own, and a lean one for one rank.

Both hold a KV cache for a batch of rows that share cache slots, run a chunk of tokens at a
slot offset and return the logits of the last fed position (plus the routed experts when asked).

* `MegatronDecoder`: `GPTModel.forward` with megatron's `StaticInferenceContext`. Works on every
  layout the embedded engine accepts (TP with or without SP, EP, ETP, DP), but every row must
  start at slot 0 (megatron's static cache gives all rows the same positions and its local
  attention takes no padding mask), and megatron's per-module overhead costs ~3.5 ms per decode
  step on CPU even for a two-layer model.
* `TorchDecoder` (rollout/embedded/torch_decoder.py): the same Qwen3 / Qwen3-MoE math as
  a flat sequence of torch ops, bound here to the trainer's parameter tensors in place
  (`megatron_torch_decoder`). Used when the model is not split (tp = ep = etp = 1) and has the
  local-spec Qwen3(-MoE) structure, LoRA adapters included (merged into their weights at each
  batch); `check_against` compares it with `GPTModel.forward` before it is trusted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from gspo_megatron.device import accelerator
from gspo_megatron.megatron.lora import ADAPTED_LAYERS
from gspo_megatron.rollout.embedded.torch_decoder import (
    DecoderLayer,
    DecoderSpec,
    DecoderWeights,
    TorchDecoder,
    qk_norm_weights,
)


class MegatronDecoder:
    """`GPTModel.forward` with a static KV cache (megatron's inference context)."""

    name = "megatron"
    left_pad = False  # megatron's static cache gives every row the same positions
    # At a slot offset > 0 megatron's static inference turns the attention mask off (one token
    # per step is all it expects past the prompt), so new tokens prefilled after a kept context
    # would see the ones after them: every prompt is prefilled whole, counted as
    # rollout/prefix_cache_unsupported.
    keeps_context = False

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
    """Why `TorchDecoder` cannot run this model chunk over its own parameters, or None."""
    if config.tensor_model_parallel_size != 1 or config.expert_model_parallel_size != 1:
        return "the model is split over ranks (tensor or expert parallelism)"
    if (config.expert_tensor_parallel_size or 1) != 1:
        return "expert tensor parallelism"
    if not (model.pre_process and model.post_process):
        return "the model is split over pipeline stages"
    return torch_decoder_math_unsupported(model, config) or _module_unsupported(model)


def torch_decoder_math_unsupported(model, config) -> str | None:
    """Model features `TorchDecoder`'s math lacks (whatever holds the weights), or None."""
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
    return None


def _module_unsupported(model) -> str | None:
    """Module types whose parameters `megatron_decoder_weights` cannot read, or None."""
    read = (".linear_qkv", ".linear_proj", ".linear_fc1", ".linear_fc2")
    for name, module in model.named_modules():
        # A fresh adapter adds nothing, so `check_against` would pass an adapter the decoder
        # does not merge, which, once trained, would be left out of every rollout.
        if isinstance(module, ADAPTED_LAYERS) and not name.endswith(read):
            return f"a LoRA adapter on {name} (it merges those of {', '.join(read)} only)"
    if not isinstance(getattr(model.decoder, "final_layernorm", None), torch.nn.RMSNorm):
        return "final norm (a torch RMSNorm expected)"
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


def decoder_spec(model, config, vocab_size: int) -> DecoderSpec:
    """The `TorchDecoder` shape facts of a megatron model chunk and its TransformerConfig."""
    dtypes = {"fp32": torch.float32, "fp64": torch.float64}
    scale = getattr(model.decoder.layers[0].self_attention.core_attention, "softmax_scale", None)
    return DecoderSpec(
        heads=config.num_attention_heads,
        groups=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        topk=config.moe_router_topk or 0,
        pre_softmax=bool(config.moe_router_pre_softmax),
        router_dtype=dtypes.get(config.moe_router_dtype),
        vocab_size=vocab_size,
        scale=scale or 1.0 / math.sqrt(config.kv_channels),
    )


def _weight(linear) -> torch.Tensor:
    """A linear layer's weight as the model applies it: a LoRA layer's with its adapter merged
    (megatron/lora.py), else the parameter itself."""
    if isinstance(linear, ADAPTED_LAYERS):
        return linear.effective_weight()
    return linear.weight


def megatron_decoder_weights(model, spec: DecoderSpec) -> DecoderWeights:
    """`DecoderWeights` over a megatron model chunk's parameters, read at each batch: views of
    them (no copy: the optimizer's in-place updates are seen by the next batch), except a LoRA
    layer's weight, merged with its adapter into a copy for the batch (base + alpha/r * B @ A;
    whole weights trained beside the adapters, lora.modules_to_save, are plain parameters)."""
    out = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )
    final = model.decoder.final_layernorm
    layers = []
    for layer in model.decoder.layers:
        attn = layer.self_attention
        qk_norm = None
        if not isinstance(attn.q_layernorm, IdentityOp):
            q, k = attn.q_layernorm, attn.k_layernorm
            qk_norm = (qk_norm_weights(q.weight, k.weight, spec.per_group), q.eps)
        mlp = layer.mlp
        if isinstance(mlp, MoELayer):
            router_t = mlp.router.weight.to(spec.router_dtype or mlp.router.weight.dtype).t()
            experts = mlp.experts.local_experts
        else:
            router_t, experts = None, [mlp]
        layers.append(
            DecoderLayer(
                norm_in=(layer.input_layernorm.weight, layer.input_layernorm.eps),
                qkv_t=_weight(attn.linear_qkv).t(),
                qk_norm=qk_norm,
                proj_t=_weight(attn.linear_proj).t(),
                norm_mlp=(layer.pre_mlp_layernorm.weight, layer.pre_mlp_layernorm.eps),
                router_t=router_t,
                mlps=[(_weight(e.linear_fc1).t(), _weight(e.linear_fc2).t()) for e in experts],
            )
        )
    return DecoderWeights(
        embedding=model.embedding.word_embeddings.weight,
        output_t=out[: spec.vocab_size].t(),
        final_norm=(final.weight, final.eps),
        layers=layers,
        rope=lambda total: model.rotary_pos_emb.get_emb(total)[:, 0, 0, :],
    )


def megatron_torch_decoder(model, config, vocab_size: int, record_routes: bool = False):
    """A `TorchDecoder` over a megatron model chunk's own parameters."""
    spec = decoder_spec(model, config, vocab_size)
    return TorchDecoder(spec, lambda: megatron_decoder_weights(model, spec), record_routes)


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
