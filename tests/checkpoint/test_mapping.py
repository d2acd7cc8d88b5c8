"""The HF <-> megatron name mapping: layouts checked against independent constructions."""

from __future__ import annotations

import json
import types

import pytest
import torch

from gspo_megatron.checkpoint.hf_io import read_hf_config
from gspo_megatron.checkpoint.mapping import (
    ConversionError,
    get_mapping,
    qkv_to_hf,
    qkv_to_megatron,
    unexpected_hf_names,
)
from gspo_megatron.spec.model_config import ModelConfig


def _cfg(**changes) -> ModelConfig:
    base = dict(
        model_type="qwen3_moe",
        vocab_size=51,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=4,
        num_experts=3,
        num_experts_per_tok=2,
        moe_intermediate_size=5,
        intermediate_size=7,
        make_vocab_size_divisible_by=16,
    )
    base.update(changes)
    return ModelConfig(**base)


def test_qkv_rows_are_grouped_per_kv_head_like_megatron():
    cfg = _cfg()  # 6 query heads, 2 KV groups of 3, head_dim 4
    h, d = cfg.hidden_size, cfg.head_dim
    q = torch.randn(6 * d, h)
    k = torch.randn(2 * d, h)
    v = torch.randn(2 * d, h)
    # megatron: for each KV group g, [its 3 query heads; k_g; v_g] (attention.py splits
    # [ng, (np/ng + 2) * hn] as [np/ng * hn, hn, hn])
    expected = []
    for g in range(2):
        expected += [q[(3 * g + j) * d : (3 * g + j + 1) * d] for j in range(3)]
        expected += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    qkv = qkv_to_megatron(q, k, v, cfg)
    assert torch.equal(qkv, torch.cat(expected))
    back = qkv_to_hf(qkv, cfg)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    # a TP shard of megatron's rows is whole KV groups: TP rank 1 of 2 holds group 1
    assert torch.equal(qkv[qkv.shape[0] // 2 :], torch.cat(expected[5:]))


def test_gate_up_fuse_as_megatron_swiglu_reads_it():
    cfg = _cfg()
    m = get_mapping(cfg)
    entry = m.unit("decoder.layers.mlp.experts.experts.linear_fc1.weight", (1, 2))
    assert entry.hf_names == (
        "model.layers.1.mlp.experts.2.gate_proj.weight",
        "model.layers.1.mlp.experts.2.up_proj.weight",
    )
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    fc1 = m.to_megatron(entry, [gate, up])
    x = torch.randn(3, 8)
    # megatron's glu: silu(first half) * second half of fc1(x)
    a, b = torch.chunk(x @ fc1.t(), 2, dim=-1)
    hf = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
    assert torch.allclose(torch.nn.functional.silu(a) * b, hf)
    assert all(torch.equal(p, q) for p, q in zip(m.to_hf(entry, fc1), (gate, up), strict=True))


def test_vocab_rows_padded_on_import_and_dropped_on_export():
    m = get_mapping(_cfg())
    entry = m.unit("embedding.word_embeddings.weight", ())
    assert entry.shape == (64, 8)  # 51 rows padded to a multiple of 16
    emb = torch.randn(51, 8)
    padded = m.to_megatron(entry, [emb])
    assert torch.equal(padded[:51], emb) and not padded[51:].any()
    assert torch.equal(m.to_hf(entry, padded)[0], emb)


def test_every_hf_tensor_mapped_once_in_file_order():
    for cfg in (_cfg(), _cfg(model_type="qwen3", tie_word_embeddings=True)):
        m = get_mapping(cfg)
        names = m.hf_names
        assert len(names) == len(set(names))
        assert names[0] == "model.embed_tokens.weight" and names[-1] in (
            "lm_head.weight",
            "model.norm.weight",
        )
        assert ("lm_head.weight" in names) != cfg.tie_word_embeddings
    moe = get_mapping(_cfg())
    per_layer = 1 + 3 + 1 + 2 + 1 + 1 + 3 * 3  # norms, qkv, o, q/k norm, post norm, gate, experts
    assert len(moe.hf_names) == 2 * per_layer + 3


def test_wrong_shape_names_the_tensor():
    m = get_mapping(_cfg())
    entry = m.unit("decoder.layers.self_attention.linear_proj.weight", (0,))
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        m.to_megatron(entry, [torch.zeros(3, 3)])


def test_unknown_architecture_is_refused_by_name(tmp_path):
    fake = types.SimpleNamespace(model_type="llama", architecture="LlamaForCausalLM")
    with pytest.raises(ConversionError, match="llama"):
        get_mapping(fake)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(ConversionError, match="llama"):
        read_hf_config(tmp_path)


def test_attention_bias_is_refused():
    with pytest.raises(ConversionError, match="attention_bias"):
        get_mapping(_cfg(attention_bias=True))


def _hf_moe_config(**changes) -> dict:
    base = {
        "model_type": "qwen3_moe",
        "vocab_size": 51,
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 5,
        "intermediate_size": 7,
    }
    base.update(changes)
    return base


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "yarn"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"use_sliding_window": True, "sliding_window": 16}, "sliding"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"rope_theta": 10000.5}, "rope_theta"),
    ],
)
def test_config_fields_that_change_the_math_are_refused(tmp_path, changes, match):
    (tmp_path / "config.json").write_text(json.dumps(_hf_moe_config(**changes)))
    with pytest.raises(ConversionError, match=match):
        read_hf_config(tmp_path)


def test_config_defaults_follow_transformers(tmp_path):
    # transformers 5 writes num_local_experts; absent norm_topk_prob means transformers' False
    raw = _hf_moe_config(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    raw["num_local_experts"] = raw.pop("num_experts")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, _ = read_hf_config(tmp_path)
    assert cfg.num_experts == 3 and cfg.norm_topk_prob is False and cfg.rope_theta == 5e5


def test_tied_checkpoint_may_carry_lm_head():
    tied = get_mapping(_cfg(model_type="qwen3", tie_word_embeddings=True))
    assert unexpected_hf_names(tied, ["lm_head.weight", "model.layers.0.rotary_emb.inv_freq"]) == []
    untied = get_mapping(_cfg())
    assert unexpected_hf_names(untied, ["model.layers.0.mlp.shared_expert.weight"]) == [
        "model.layers.0.mlp.shared_expert.weight"
    ]
