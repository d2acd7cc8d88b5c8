"""A LoRA policy's adapters under Hugging Face PEFT names, and merging them into base weights.

The megatron side (megatron/lora.py) keeps one adapter per megatron linear layer: `lora_a`
[r, in] and `lora_b` [out, r] under the layer's sharded key, e.g.
`decoder.layers.self_attention.linear_qkv.lora_a`, stacked over layers (and experts). PEFT
keeps one per Hugging Face linear module, `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r]. A fused megatron layer (q/k/v, gate/up) is several HF
modules that share its input, so its adapter is theirs exactly: each gets the same A, and B is
split like the weight's rows (`qkv`, `gate_up` of checkpoint/mapping.py). The names here are in
the HF model's namespace (`model.layers.0.self_attn.q_proj.lora_A.weight`); a PEFT file puts
`checkpoint.lora_export.PEFT_PREFIX` before them (lora_export also writes PEFT's
adapter_config.json).

`adapter_mapping` is a `ModelMapping` of those units, so the weight export's gather
(megatron/weight_export.py) moves adapters from any layout as it moves weights.
`merge_adapters` adds scaling * B @ A to the weights the adapters sit on (`merged_weight`, with
which the embedded engine's torch decoder also merges a megatron layer's adapter). Imports no
megatron code (the generator process merges with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo_megatron.checkpoint.mapping import KeySpec, ModelMapping, Shape, TensorMapping

if TYPE_CHECKING:
    from gspo_megatron.spec.lora import LoRASettings
    from gspo_megatron.spec.model_config import ModelConfig

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class _AdapterRule:
    """One adaptable megatron layer (a `lora.targets` name) and its HF modules."""

    target: str
    key: str  # the megatron layer's sharded key, without .lora_a / .lora_b
    modules: tuple[str, ...]  # HF module name templates ({layer}, {expert})
    per: str  # layer | expert
    b_kind: str  # how B's rows split over the modules: copy | qkv | gate_up


_L = "decoder.layers."
_P = "model.layers.{layer}."
_X = "model.layers.{layer}.mlp.experts.{expert}."
_RULES = (
    _AdapterRule(
        "attention.linear_qkv", _L + "self_attention.linear_qkv",
        (_P + "self_attn.q_proj", _P + "self_attn.k_proj", _P + "self_attn.v_proj"), "layer",
        "qkv",
    ),
    _AdapterRule(
        "attention.linear_proj", _L + "self_attention.linear_proj", (_P + "self_attn.o_proj",),
        "layer", "copy",
    ),
    _AdapterRule(
        "mlp.linear_fc1", _L + "mlp.linear_fc1", (_P + "mlp.gate_proj", _P + "mlp.up_proj"),
        "layer", "gate_up",
    ),
    _AdapterRule("mlp.linear_fc2", _L + "mlp.linear_fc2", (_P + "mlp.down_proj",), "layer", "copy"),
    _AdapterRule(
        "experts.linear_fc1", _L + "mlp.experts.experts.linear_fc1",
        (_X + "gate_proj", _X + "up_proj"), "expert", "gate_up",
    ),
    _AdapterRule(
        "experts.linear_fc2", _L + "mlp.experts.experts.linear_fc2", (_X + "down_proj",),
        "expert", "copy",
    ),
)  # fmt: skip


def _in_out(target: str, c: ModelConfig) -> tuple[int, int]:
    """The adapted layer's (input, output) features, unsharded."""
    qkv_rows = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return {
        "attention.linear_qkv": (c.hidden_size, qkv_rows),
        "attention.linear_proj": (c.num_attention_heads * c.head_dim, c.hidden_size),
        "mlp.linear_fc1": (c.hidden_size, 2 * (c.intermediate_size or 0)),
        "mlp.linear_fc2": (c.intermediate_size or 0, c.hidden_size),
        "experts.linear_fc1": (c.hidden_size, 2 * (c.moe_intermediate_size or 0)),
        "experts.linear_fc2": (c.moe_intermediate_size or 0, c.hidden_size),
    }[target]


class AdapterMapping(ModelMapping):
    """The adapters' units: A of a fused layer is `shared` (the same tensor under every HF
    module's name); B splits as the layer's weight does."""

    def to_hf(self, entry: TensorMapping, unit: torch.Tensor) -> list[torch.Tensor]:
        if entry.kind == "shared":
            if tuple(unit.shape) != entry.shape:
                raise ValueError(
                    f"adapter {entry.key}{list(entry.index)} has shape {list(unit.shape)}, "
                    f"expected {list(entry.shape)}"
                )
            # copies: a writer of files (safetensors) refuses tensors sharing memory
            return [unit, *(unit.clone() for _ in entry.hf_names[1:])]
        return super().to_hf(entry, unit)


def adapter_mapping(cfg: ModelConfig, lora: LoRASettings) -> AdapterMapping:
    """The units of the adapters `lora.targets` puts on a model, layer by layer (experts in
    order) in HF order."""
    from gspo_megatron.spec.lora import resolve_targets

    targets = resolve_targets(lora.targets, cfg.is_moe)
    rules = [r for r in _RULES if r.target in targets]
    m = AdapterMapping(cfg)
    layers, experts = cfg.num_hidden_layers, cfg.num_experts if cfg.is_moe else 0
    stacked = {"layer": (layers,), "expert": (layers, experts)}
    r = lora.rank
    for rule in rules:
        fan_in, fan_out = _in_out(rule.target, cfg)
        m.add_key(KeySpec(rule.key + ".lora_a", stacked[rule.per], (r, fan_in)))
        m.add_key(KeySpec(rule.key + ".lora_b", stacked[rule.per], (fan_out, r)))

    def add(rule: _AdapterRule, index: Shape, **fmt) -> None:
        modules = [name.format(**fmt) for name in rule.modules]
        fan_in, fan_out = _in_out(rule.target, cfg)
        a_kind = "shared" if len(modules) > 1 else "copy"
        m.add(rule.key + ".lora_a", index, a_kind, [(n + LORA_A, (r, fan_in)) for n in modules])
        b_rows = [
            t.shape[0]
            for t in m.to_hf(
                TensorMapping(rule.key, (), tuple(modules), (), rule.b_kind, (fan_out, r)),
                torch.empty(fan_out, r, device="meta"),
            )
        ]
        b_names = [(n + LORA_B, (rows, r)) for n, rows in zip(modules, b_rows, strict=True)]
        m.add(rule.key + ".lora_b", index, rule.b_kind, b_names)

    for layer in range(layers):
        for rule in rules:
            if rule.per == "layer":
                add(rule, (layer,), layer=layer)
            else:
                for expert in range(experts):
                    add(rule, (layer, expert), layer=layer, expert=expert)
    return m


def adapted_weights(names) -> dict[str, tuple[str, str]]:
    """Base weight name -> (its lora_A, its lora_B name), for every adapter among `names`."""
    out = {}
    for name in names:
        if name.endswith(LORA_A):
            module = name.removesuffix(LORA_A)
            out[module + ".weight"] = (name, module + LORA_B)
    return out


def merged_weight(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """weight + scaling * b @ a, computed in float32 at least (the caller casts it back).

    Also right for a tensor-parallel shard: a column-parallel layer's B and weight are split
    along the output (A whole), a row-parallel one's A and weight along the input (B whole)."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    return torch.addmm(weight.to(dtype), b.to(dtype), a.to(dtype), alpha=scaling)


def merge_adapters(
    weights: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    scaling: float,
    out: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """`weights` with scaling * B @ A added to every one an adapter sits on (computed in float32
    at least, cast to the weight's dtype); weights without an adapter are passed as they are.
    `out`: write merged weights into these tensors (same names) instead of new ones."""
    pairs = adapted_weights(adapters)
    merged = dict(weights)
    for name, weight in weights.items():
        if name not in pairs:
            continue
        a, b = (adapters[n] for n in pairs[name])
        value = merged_weight(weight, a, b, scaling)
        if out is not None:
            merged[name] = out[name].copy_(value)
        else:
            merged[name] = value.to(weight.dtype)
    return merged
