"""Build the Qwen3 / Qwen3-MoE policy (or value / reward model) as megatron-core GPTModel chunks
for a parallel layout."""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from gspo_megatron.device import accelerator, on_accelerator
from gspo_megatron.megatron.attention import LocalCoreAttention
from gspo_megatron.megatron.cpu_compat import cuda_available
from gspo_megatron.megatron.lora import lora_layer_spec
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings, resolve_targets
from gspo_megatron.spec.model_config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_engine_available() -> bool:
    return cuda_available() and importlib.util.find_spec("transformer_engine") is not None


# megatron-core's load-balancing losses that leave routing as the model defines it (sinkhorn
# changes the routing itself, which the rollout engine would not reproduce).
MOE_AUX_LOSSES = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss")


def transformer_config(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    recompute: bool = False,
    moe_aux_loss: str = "none",
    moe_aux_loss_coef: float = 0.0,
) -> TransformerConfig:
    """megatron's TransformerConfig for a Qwen3(-MoE) model on a layout.

    moe_aux_loss / moe_aux_loss_coef: the MoE load-balancing loss added to the policy loss
    (algorithm.moe_aux_loss; off by default for RL, see docs/ALGORITHMS.md).
    """
    if moe_aux_loss not in MOE_AUX_LOSSES:
        raise ValueError(
            f"moe_aux_loss must be one of {list(MOE_AUX_LOSSES)}, got {moe_aux_loss!r}"
        )
    dtype = _DTYPES[model.params_dtype]
    on_gpu = cuda_available()
    kwargs = dict(
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.intermediate_size or 4 * model.hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        pipeline_dtype=dtype,
        # gloo matches batched sends and receives to the same peer by order, so with a
        # two-stage interleaved pipeline the two directions swap same-shaped messages; megatron's
        # unbatched path keeps the directions on separate process groups.
        batch_p2p_comm=on_gpu,
        # Micro-batches differ in padded length; the pipeline communicates shapes first (which
        # megatron refuses with its default allgather dispatcher, even for dense models).
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        # Without an accelerator, weights are drawn on CPU as full tensors and then split, so a
        # model initialised from the same seed has the same weights on every TP/EP layout; on an
        # accelerator (or the emulated one) each rank draws its shard in place.
        use_cpu_initialization=not on_accelerator(),
        # Fusions that need CUDA kernels (apex / TE / triton).
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )
    if model.is_moe:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.num_experts_per_tok,
            moe_ffn_hidden_size=model.moe_intermediate_size,
            # Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob.
            # megatron's pre_softmax=False (top-k of logits, softmax over the k) is the same
            # renormalised distribution; pre_softmax=True keeps the unnormalised top-k.
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not model.norm_topk_prob,
            moe_router_load_balancing_type=moe_aux_loss,
            moe_aux_loss_coeff=moe_aux_loss_coef if moe_aux_loss != "none" else 0.0,
            moe_router_dtype="fp32",
            moe_grouped_gemm=transformer_engine_available(),
            moe_permute_fusion=False,
        )
    if on_gpu:
        kwargs.update(bias_dropout_fusion=True)
    return TransformerConfig(**kwargs)


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron's norm constructor, usable with sequence parallelism.

    megatron's torch-native norm wrapper refuses sequence parallelism; with SP each TP rank
    normalises a different slice of the sequence, so the weight is tagged for megatron to sum
    its gradient over TP.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


class ValueHead(torch.nn.Module):
    """The scalar head of a value or reward model in place of GPTModel's output layer:
    hidden [s, b, h] -> [s, b, 1], one weight row replicated over TP (HF's `score.weight` of
    `*ForSequenceClassification` with one label).

    Under sequence parallelism each TP rank holds a slice of the sequence: the head runs on its
    slice and the values are gathered; the backward keeps each rank's slice of the gradient
    (every TP rank computes the same loss, so nothing is summed), and the weight's gradient,
    from this rank's slice only, is summed over TP by megatron (the `sequence_parallel` tag)
    like the norms'. Initialised to zero: a new critic predicts 0 everywhere, on every layout.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.zeros(1, config.hidden_size, dtype=config.params_dtype)
        )
        self.sequence_parallel = config.sequence_parallel
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        values = F.linear(hidden, self.weight)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(
                values,
                tensor_parallel_output_grad=False,
                group=parallel_state.get_tensor_model_parallel_group(),
            )
        return values, None


def layer_spec(model: ModelConfig, *, use_te: bool | None = None) -> ModuleSpec:
    """The decoder layer spec; checkpoint keys are those of the transformer-engine spec.

    Local spec, MoE layers: megatron maps the pre-MLP norm to `mlp.linear_fc1.layer_norm_*`
    (TE's fused name for dense MLPs), but the TE spec keeps MoE layers' norm at
    `pre_mlp_layernorm.*`. We drop that mapping so one checkpoint loads on both.
    """
    if use_te is None:
        use_te = transformer_engine_available()
    num_experts = model.num_experts if model.is_moe else None
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=model.is_moe, qk_layernorm=True
        )
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=True, normalization="RMSNorm"
    )
    submodules = dataclasses.replace(
        spec.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm
    )
    keys_map = dict(submodules.sharded_state_dict_keys_map)
    if model.is_moe:
        keys_map.pop("pre_mlp_layernorm.", None)
    attention = submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(
            attention.submodules,
            core_attention=LocalCoreAttention,
            q_layernorm=RMSNorm,
            k_layernorm=RMSNorm,
        ),
    )
    return dataclasses.replace(
        spec,
        submodules=dataclasses.replace(
            submodules, self_attention=attention, sharded_state_dict_keys_map=keys_map
        ),
    )


def build_model_chunks(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    config: TransformerConfig | None = None,
    use_te: bool | None = None,
    value_head: bool = False,
    lora: LoRASettings | None = None,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), parallel state initialised.

    value_head: a value / reward model, the last stage ending in a `ValueHead` instead of the
    vocabulary projection (never tied to the embedding).
    lora: LoRA adapters on lora.targets' layers (megatron/lora.py); megatron's local layers only.
    """
    config = config or transformer_config(model, layout)
    if use_te is None:
        use_te = transformer_engine_available()
    spec = layer_spec(model, use_te=use_te)
    if lora is not None and lora.enabled:
        if use_te:
            raise ValueError(
                "lora.rank is set with transformer-engine layers (engine.use_te, or null on a GPU "
                "with transformer_engine): LoRA adapts megatron's local layers; set "
                "engine.use_te=false"
            )
        spec = lora_layer_spec(spec, lora, resolve_targets(lora.targets, model.is_moe))
    vpp = layout.vpp
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        block_spec = spec
        if not use_te:
            num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
            block_spec = TransformerBlockSubmodules(
                layer_specs=[spec] * num_layers, layer_norm=RMSNorm
            )
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=block_spec,
            vocab_size=model.padded_vocab_size(tp),
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=model.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=int(model.rope_theta),
            parallel_output=True,
            vp_stage=vp_stage,
        )
        if value_head and post:
            chunk.output_layer = ValueHead(config)
        # Some parameters are created on the host whatever the init path (megatron's router
        # weights, our norms); like megatron's own get_model, place the whole chunk at once
        # (unless it was built on the meta device, to be counted and never run).
        if not any(p.is_meta for p in chunk.parameters()):
            chunk = chunk.to(accelerator())
        chunks.append(chunk)
    return chunks
