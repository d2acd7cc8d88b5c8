"""A LoRA policy's adapters in Hugging Face form: merged into the base weights, or as a PEFT
adapter (`adapter_model.safetensors` + `adapter_config.json`) that `peft` loads onto the
transformers model (docs/LORA.md, "Export").

The adapters of a megatron layer are `<weight key without .weight>.lora_a` [.., r, in] and
`.lora_b` [.., out, r], stacked over layers (and experts) like the weight, whole in a checkpoint
whatever the layout it was saved on. What megatron fuses, HF splits, and the adapter with it:

- q/k/v (`linear_qkv`): B's rows are split like the weight's (megatron's per-KV-group
  [q_g; k_g; v_g] into q_proj, k_proj, v_proj); q, k and v share A. Exact: each of them
  computes B_x A x.
- a dense MLP's fc1 (`[gate; up]`): gate_proj and up_proj share A, B is split in halves.
- the experts: transformers 5 holds a layer's experts as two 3-D parameters,
  `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], which PEFT adapts
  through `target_parameters` (its `ParamWrapper`): one lora_A [E·r, in] whose rows e·r..(e+1)·r
  are expert e's A, one lora_B [out, r·E] whose column j·E+e is column j of expert e's B. Each
  expert keeps its own rank-r adapter, exactly. When both are targeted PEFT nests its wrappers
  in the order the parameters are defined (gate_up_proj inside, under `base_layer`).
- `lora.modules_to_save` (whole trained weights) are saved under their HF names, as PEFT saves
  its modules_to_save.

Pure PyTorch: the functions take whole (unsharded) A and B per megatron unit, so that whatever
gathers them (the checkpoint reader here; a live engine's gather for weight sync) names them the
same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from gspo_megatron.checkpoint.lora_mapping import merged_weight
from gspo_megatron.checkpoint.mapping import ModelMapping, TensorMapping, qkv_to_hf
from gspo_megatron.spec.lora import resolve_targets

# lora.targets name -> the megatron weight key it adapts
TARGET_WEIGHT_KEYS = {
    "attention.linear_qkv": "decoder.layers.self_attention.linear_qkv.weight",
    "attention.linear_proj": "decoder.layers.self_attention.linear_proj.weight",
    "mlp.linear_fc1": "decoder.layers.mlp.linear_fc1.weight",
    "mlp.linear_fc2": "decoder.layers.mlp.linear_fc2.weight",
    "experts.linear_fc1": "decoder.layers.mlp.experts.experts.linear_fc1.weight",
    "experts.linear_fc2": "decoder.layers.mlp.experts.experts.linear_fc2.weight",
}
# experts' megatron key -> transformers' 3-D parameter of the layer's experts, in the order
# Qwen3MoeExperts defines them (PEFT nests its wrappers in that order)
EXPERT_PARAMETERS = {
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": "gate_up_proj",
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": "down_proj",
}
# lora.modules_to_save name -> the HF module PEFT's modules_to_save names
SAVED_HF_MODULES = {
    "output_layer": "lm_head",
    "final_norm": "model.norm",
    "embedding": "model.embed_tokens",
}
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def adapter_keys(weight_key: str) -> tuple[str, str]:
    """The checkpoint keys of the A and B adapting megatron weight `weight_key`."""
    stem = weight_key.removesuffix(".weight")
    return f"{stem}.lora_a", f"{stem}.lora_b"


def adapted_weight_keys(lora: dict[str, Any], is_moe: bool) -> list[str]:
    """The megatron weight keys the adapters of a `lora` section (a checkpoint's metadata)
    adapt, in mapping order."""
    targets = resolve_targets(lora["targets"], is_moe, key="the checkpoint's lora.targets")
    return [key for name, key in TARGET_WEIGHT_KEYS.items() if name in targets]


def scaling(lora: dict[str, Any]) -> float:
    return float(lora["alpha"]) / int(lora["rank"])


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """weight + scale · B @ A (one megatron unit, its layout: B's rows are the weight's rows) in
    the weight's dtype: the trainer's own merge (`lora_mapping.merged_weight`, what its layers
    apply and what its weight sync and per-checkpoint export send), so a conversion gives the
    same model."""
    return merged_weight(weight, a, b, scale).to(weight.dtype)


def _module(hf_weight_name: str) -> str:
    return hf_weight_name.removesuffix(".weight")


def hf_adapter_tensors(
    mapping: ModelMapping, entry: TensorMapping, a: torch.Tensor, b: torch.Tensor
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module name, A, B) of the adapter of a non-expert megatron unit `entry`, B split like
    the weight (q/k/v, gate/up), A shared by the parts."""
    if entry.kind == "qkv":
        parts = qkv_to_hf(b, mapping.config)
    elif entry.kind == "gate_up":
        parts = list(torch.chunk(b, 2, dim=0))
    elif entry.kind == "copy":
        parts = [b]
    else:
        raise ValueError(f"{entry.key}: a {entry.kind} unit has no adapter")
    return [
        (_module(name), a.clone(), part.contiguous())
        for name, part in zip(entry.hf_names, parts, strict=True)
    ]


def expert_peft_tensors(
    layer: int, weight_key: str, adapters: list[tuple[torch.Tensor, torch.Tensor]], nested: bool
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(PEFT module name, lora_A [E·r, in], lora_B [out, r·E]) of one layer's experts from each
    expert's (A [r, in], B [out, r]) in expert order (module docstring). `nested`: the layer's
    gate_up_proj is adapted too and down_proj's wrapper holds it as its `base_layer`."""
    a = torch.cat([a for a, _ in adapters], dim=0)
    b = torch.stack([b for _, b in adapters], dim=-1)  # [out, r, E]: column j·E + e
    b = b.reshape(b.shape[0], -1)
    module = f"model.layers.{layer}.mlp.experts"
    if nested and EXPERT_PARAMETERS[weight_key] == "gate_up_proj":
        module += ".base_layer"
    return module, a.contiguous(), b.contiguous()


def peft_state_items(
    mapping: ModelMapping,
    units: Iterable[tuple[TensorMapping, torch.Tensor, torch.Tensor]],
    adapted: list[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, tensor) of every adapter, from (entry, A, B) of each adapted megatron unit in
    mapping order (a layer's experts consecutive). `adapted`: the adapted weight keys."""
    nested = all(key in adapted for key in EXPERT_PARAMETERS)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for entry, a, b in units:
        if entry.key in EXPERT_PARAMETERS:
            pending.append((a, b))
            if len(pending) < mapping.config.num_experts:
                continue
            pieces = [expert_peft_tensors(entry.index[0], entry.key, pending, nested)]
            pending = []
        else:
            pieces = hf_adapter_tensors(mapping, entry, a, b)
        for module, a_part, b_part in pieces:
            yield f"{PEFT_PREFIX}{module}.lora_A.weight", a_part
            yield f"{PEFT_PREFIX}{module}.lora_B.weight", b_part
    if pending:
        raise ValueError("the experts' adapters of a layer ended before its last expert")


def saved_module_key(hf_weight_name: str) -> str:
    """The PEFT key of a whole trained weight (lora.modules_to_save) by its HF name."""
    return f"{PEFT_PREFIX}{hf_weight_name}"


def adapter_config(
    lora: dict[str, Any], adapted: list[str], mapping: ModelMapping, base_model: str | None
) -> dict[str, Any]:
    """PEFT's adapter_config.json of the adapters (LoraConfig's fields; PEFT fills the rest)."""
    modules: set[str] = set()
    parameters = []
    for key in adapted:
        if key in EXPERT_PARAMETERS:
            parameters.append(f"mlp.experts.{EXPERT_PARAMETERS[key]}")
            continue
        entry = next(e for e in mapping.entries if e.key == key)
        modules.update(_module(name).rsplit(".", 1)[-1] for name in entry.hf_names)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": sorted(modules),
        "target_parameters": parameters or None,
        "modules_to_save": [SAVED_HF_MODULES[name] for name in lora.get("modules_to_save", [])]
        or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter_config(path: Path, config: dict[str, Any]) -> None:
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
