"""The checkpoint keys of megatron-core 0.19.2's transformer-engine layer spec, written down
from its source (transformer-engine cannot be imported on CPU machines, so the TE spec cannot
be built here; a GPU machine with TE can compare against a real model).

get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm=True,
qk_layernorm=True) gives, per layer:
- self_attention.linear_qkv: TELayerNormColumnParallelLinear -> `weight` and the fused input
  norm `layer_norm_weight` (extensions/transformer_engine.py, sharded_state_dict);
- self_attention.linear_proj: TERowParallelLinear -> `weight`;
- self_attention.q_layernorm / k_layernorm: TENorm -> `weight`;
- self_attention.core_attention: TEDotProductAttention -> nothing (softmax_type "vanilla");
- MoE layers: pre_mlp_layernorm: TENorm -> `pre_mlp_layernorm.weight` (not fused);
  mlp.router.weight; mlp.experts: TEGroupedMLP, whose sharded_state_dict maps the grouped
  GEMM's `weight{i}` to SequentialMLP's keys `mlp.experts.experts.linear_fc{1,2}.weight`
  stacked [layers, experts, ...] (transformer/moe/experts.py: "interchangeable with
  SequentialMLP's"), fc1 as cat(gate, up) through apply_swiglu_sharded_factory;
- dense layers: mlp.linear_fc1: TELayerNormColumnParallelLinear -> `weight` and the fused
  pre-MLP norm `layer_norm_weight`; mlp.linear_fc2 -> `weight`;
- outside the layers: embedding.word_embeddings.weight, decoder.final_layernorm.weight
  (TENorm), output_layer.weight (untied only). Per-layer keys carry the layer as a leading
  axis; embedding/output rows are the padded vocabulary (loaded with allow_shape_mismatch).

Every TE module also stores `_extra_state` (FP8 metadata), the norms included; the local spec
stores it for linear layers only. `te_only_extra_state` lists the ones the local spec lacks.
"""

from __future__ import annotations


def te_spec_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    L, H, d = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    vocab = cfg.padded_vocab_size(1)
    shapes = {
        "embedding.word_embeddings.weight": (vocab, H),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
        "decoder.layers.self_attention.linear_qkv.weight": (L, (nq + 2 * nkv) * d, H),
        "decoder.layers.self_attention.linear_proj.weight": (L, H, nq * d),
        "decoder.layers.self_attention.q_layernorm.weight": (L, d),
        "decoder.layers.self_attention.k_layernorm.weight": (L, d),
        "decoder.final_layernorm.weight": (H,),
    }
    if cfg.is_moe:
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        shapes.update(
            {
                "decoder.layers.pre_mlp_layernorm.weight": (L, H),
                "decoder.layers.mlp.router.weight": (L, E, H),
                "decoder.layers.mlp.experts.experts.linear_fc1.weight": (L, E, 2 * inter, H),
                "decoder.layers.mlp.experts.experts.linear_fc2.weight": (L, E, H, inter),
            }
        )
    else:
        inter = cfg.intermediate_size
        shapes.update(
            {
                "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
                "decoder.layers.mlp.linear_fc1.weight": (L, 2 * inter, H),
                "decoder.layers.mlp.linear_fc2.weight": (L, H, inter),
            }
        )
    if not cfg.tie_word_embeddings:
        shapes["output_layer.weight"] = (vocab, H)
    return shapes


def te_only_extra_state(cfg) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(key, global_shape, global_offset) of the TE norms' `_extra_state` objects."""
    L = cfg.num_hidden_layers
    names = ["self_attention.q_layernorm", "self_attention.k_layernorm"]
    if cfg.is_moe:
        names.append("pre_mlp_layernorm")
    out = [
        (f"decoder.layers.{name}._extra_state", (L,), (layer,))
        for name in names
        for layer in range(L)
    ]
    out.append(("decoder.final_layernorm._extra_state", (1,), (0,)))
    return out
