"""The policy's architecture as a Hugging Face-style config (Qwen3-MoE and dense Qwen3).

This module holds no megatron import: the trainer validates configs, the memory planner counts
parameters and the checkpoint converter reads HF `config.json` files through it before any
process group exists. `gspo_megatron.megatron.model` turns it into megatron's TransformerConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from gspo_megatron import CONF_DIR

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PRESET_DIR = CONF_DIR / "model"


@dataclass(frozen=True)
class ModelConfig:
    """Field names and meanings follow transformers' Qwen3MoeConfig / Qwen3Config."""

    model_type: str = "qwen3_moe"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # dense MLP width (dense Qwen3; unused by all-MoE models)
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Mixture of experts (qwen3_moe only)
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    # Carried from and back to the HF config; RL training uses algorithm.moe_aux_loss(_coef).
    router_aux_loss_coef: float = 0.001
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    # Not HF fields: megatron-side settings of the policy
    params_dtype: str = "float32"  # float32 | bfloat16 | float16
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"model.model_type={self.model_type!r} is not supported; gspo-megatron supports "
                f"{sorted(ARCHITECTURES)} (Qwen3-MoE and dense Qwen3)"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads}"
            )
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"model.params_dtype must be float32, bfloat16 or float16, got {self.params_dtype}"
            )
        if self.is_moe:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"model.num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, model.num_experts={self.num_experts}]"
                )
            # Layers without experts would need a per-layer MoE pattern; Qwen3-MoE releases use
            # experts in every layer, so other patterns are refused rather than built wrong.
            if self.decoder_sparse_step != 1 or self.mlp_only_layers:
                raise ValueError(
                    "model.decoder_sparse_step != 1 and model.mlp_only_layers are not supported: "
                    "every layer must be a MoE layer"
                )

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rows in megatron's embedding/output layers (divisible by multiple*tp)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    # -- Hugging Face config.json ---------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """From a HF config dict; fields that change the math are carried or refused.

        Read config.json files through gspo_megatron.checkpoint.hf_io.read_hf_config, which
        normalises them with transformers first (defaults, renamed fields).
        """
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            archs = hf.get("architectures")
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"gspo-megatron converts {sorted(ARCHITECTURES)}"
            )
        if (
            hf.get("rope_scaling") not in (None, {})
            and (hf.get("rope_scaling") or {}).get("rope_type", "default") != "default"
        ):
            raise ValueError(
                f"rope_scaling={hf['rope_scaling']} is not supported (plain RoPE only)"
            )
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (silu only)")
        if model_type == "qwen3_moe" and hf.get("shared_expert_intermediate_size"):
            raise ValueError("shared experts are not part of Qwen3-MoE and are not supported")
        rope = hf.get("rope_theta")
        if rope is None:
            rope = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        values: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf.get("intermediate_size", 0) or 0,
            "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": hf["num_attention_heads"],
            "num_key_value_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            "rope_theta": float(rope),
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "max_position_embeddings": hf.get("max_position_embeddings", 32768),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "attention_bias": bool(hf.get("attention_bias", False)),
        }
        if model_type == "qwen3_moe":
            values.update(
                num_experts=hf["num_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            )
        dtype = hf.get("torch_dtype") or hf.get("dtype")
        if dtype in ("float32", "bfloat16", "float16") and "params_dtype" not in overrides:
            values["params_dtype"] = dtype
        values.update(overrides)
        return cls(**values)

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers and SGLang load."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "torch_dtype": self.params_dtype,
        }
        if self.is_moe:
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                output_router_logits=False,
            )
        return hf

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        return out


def load_preset(name: str, **overrides: Any) -> ModelConfig:
    """A model preset from conf/model/<name>.yaml (the same files Hydra composes)."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}")
    values = yaml.safe_load(path.read_text())
    values = {k: v for k, v in values.items() if k in _FIELDS}
    values.update(overrides)
    if "mlp_only_layers" in values:
        values["mlp_only_layers"] = tuple(values["mlp_only_layers"] or ())
    return ModelConfig(**values)


_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
