"""The one name mapping between Hugging Face Qwen3 / Qwen3-MoE tensors and megatron-core's.

Both directions of checkpoint conversion and the rollout side's weight export use this module;
it imports no megatron code. The megatron side is described by **sharded keys**, the
layout-independent names megatron-core's `sharded_state_dict()` gives every tensor (the names a
torch_dist checkpoint stores), not by module attribute paths:

- per-layer tensors share one key with the layer as a leading stacked axis, e.g.
  `decoder.layers.self_attention.linear_qkv.weight` has global shape [L, qkv_rows, H];
- expert tensors stack layer and expert, e.g. `decoder.layers.mlp.experts.experts.linear_fc1.weight`
  is [L, E, 2*I, H] (local-spec SequentialMLP and TE GroupedMLP write the same key);
- the keys are those of the transformer-engine spec (`gspo_megatron.megatron.model.layer_spec`
  makes the local spec write them too): the input norm is fused into linear_qkv
  (`...linear_qkv.layer_norm_weight`), a dense MLP's pre-MLP norm into linear_fc1
  (`...mlp.linear_fc1.layer_norm_weight`), a MoE layer's stays `pre_mlp_layernorm.weight`.

One `TensorMapping` is one megatron *unit* — one stacked slice of a key, e.g. layer 3's QKV or
layer 3 / expert 17's fc1 — and the HF tensors it is made of. Three transforms besides copying:

- `qkv`: megatron stores Q, K, V rows grouped per KV group, [q rows of the group's heads, k, v]
  for each of the `num_key_value_heads` groups (so TP splits whole groups);
- `gate_up`: SwiGLU fc1 is cat(gate, up) along rows in the checkpoint whatever the TP degree
  (megatron's swiglu sharded factory splits and re-joins the TP shards);
- `vocab`: embedding / output rows are padded to a multiple of `make_vocab_size_divisible_by`
  (zeros on import); export keeps the first `vocab_size` rows. megatron loads these two keys
  with `allow_shape_mismatch`, so a checkpoint padded for one TP degree loads on any other.

A value or reward model (`get_mapping(cfg, value_head=True)`) is the same transformer whose
`output_layer.weight` is the scalar head, [1, hidden], HF's `score.weight` of
`Qwen3(Moe)ForSequenceClassification` with one label; it has no `lm_head` and is never tied.
Whether a checkpoint holds one is not part of `ModelConfig` (the critic shares the policy's
architecture and is initialised from it): HF configs say it in `architectures`
(`hf_io.value_head_of`), megatron checkpoints in the stored head's shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importing gspo_megatron.megatron loads megatron-core (seconds)
    from gspo_megatron.spec.model_config import ModelConfig

Shape = tuple[int, ...]


class ConversionError(ValueError):
    """Bad conversion input; the message names the file, tensor or setting at fault."""


@dataclass(frozen=True)
class KeySpec:
    """One megatron sharded key: its stacked axes (layers, experts) and per-unit shape."""

    key: str
    stacked: Shape  # (), (L,) or (L, E)
    unit_shape: Shape
    vocab_padded: bool = False  # loaded by megatron with allow_shape_mismatch
    extra_state: bool = False  # megatron writes a `_extra_state` object per unit (linear layers)

    @property
    def global_shape(self) -> Shape:
        return self.stacked + self.unit_shape

    @property
    def extra_state_key(self) -> str:
        return self.key.removesuffix(".weight") + "._extra_state"


@dataclass(frozen=True)
class TensorMapping:
    """One megatron unit and the HF tensors it is made of."""

    key: str
    index: Shape  # position along the key's stacked axes
    hf_names: tuple[str, ...]
    hf_shapes: tuple[Shape, ...]
    kind: str  # copy | qkv | gate_up | vocab
    shape: Shape  # megatron unit shape (padded rows included for `vocab`)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# The megatron key of the output layer: the vocabulary projection, or a value model's head.
HEAD_KEY = "output_layer.weight"
VALUE_HEAD_HF_NAME = "score.weight"
LM_HEAD_HF_NAME = "lm_head.weight"


@dataclass
class ModelMapping:
    """Every megatron key and unit of one model, in a fixed (HF file) order."""

    config: ModelConfig
    value_head: bool = False  # output_layer is a value model's [1, hidden] head (score.weight)
    keys: dict[str, KeySpec] = field(default_factory=dict)
    entries: list[TensorMapping] = field(default_factory=list)
    _by_unit: dict[tuple[str, Shape], TensorMapping] = field(default_factory=dict, repr=False)
    _by_hf: dict[str, TensorMapping] = field(default_factory=dict, repr=False)

    def add_key(self, spec: KeySpec) -> None:
        self.keys[spec.key] = spec

    def add(self, key: str, index: Shape, kind: str, hf: Sequence[tuple[str, Shape]]) -> None:
        spec = self.keys[key]
        entry = TensorMapping(
            key=key,
            index=tuple(index),
            hf_names=tuple(n for n, _ in hf),
            hf_shapes=tuple(tuple(s) for _, s in hf),
            kind=kind,
            shape=spec.unit_shape,
        )
        self.entries.append(entry)
        self._by_unit[(key, entry.index)] = entry
        for name in entry.hf_names:
            self._by_hf[name] = entry

    def unit(self, key: str, index: Shape) -> TensorMapping:
        try:
            return self._by_unit[(key, tuple(index))]
        except KeyError:
            raise ConversionError(
                f"megatron tensor {key}{list(index)} is not part of this "
                f"{self.config.model_type} model"
            ) from None

    @property
    def hf_names(self) -> list[str]:
        return [n for e in self.entries for n in e.hf_names]

    @property
    def body_hf_names(self) -> list[str]:
        """The HF tensors of every unit but the output layer (the transformer alone)."""
        return [n for e in self.entries if e.key != HEAD_KEY for n in e.hf_names]

    def hf_shape(self, name: str) -> Shape:
        entry = self._by_hf[name]
        return entry.hf_shapes[entry.hf_names.index(name)]

    # -- transforms ---------------------------------------------------------------------------

    def to_megatron(self, entry: TensorMapping, hf: Sequence[torch.Tensor]) -> torch.Tensor:
        """The megatron unit from its HF tensors (shapes checked)."""
        for name, shape, tensor in zip(entry.hf_names, entry.hf_shapes, hf, strict=True):
            if tuple(tensor.shape) != shape:
                raise ConversionError(
                    f"tensor {name} has shape {list(tensor.shape)}, expected {list(shape)} for "
                    f"this {self.config.model_type} config"
                )
        return _TO_MEGATRON[entry.kind](self, entry, list(hf))

    def hf_name_of_row(self, entry: TensorMapping, row: int) -> str:
        """The HF tensor that row `row` of a megatron unit comes from (qkv: its KV group's q,
        k or v rows; gate_up: the gate half, then the up half)."""
        if entry.kind == "qkv":
            _, q_rows, kv_rows = _qkv_groups(self.config)
            within = row % (q_rows + 2 * kv_rows)
            return entry.hf_names[0 if within < q_rows else 1 if within < q_rows + kv_rows else 2]
        if entry.kind == "gate_up":
            return entry.hf_names[0 if row < entry.shape[0] // 2 else 1]
        return entry.hf_names[0]

    def to_hf(self, entry: TensorMapping, unit: torch.Tensor) -> list[torch.Tensor]:
        """The HF tensors of a megatron unit (views where possible)."""
        if tuple(unit.shape) != entry.shape:
            raise ConversionError(
                f"megatron tensor {entry.key}{list(entry.index)} has shape {list(unit.shape)}, "
                f"expected {list(entry.shape)}"
            )
        return _TO_HF[entry.kind](self, entry, unit)


# -- the transforms ---------------------------------------------------------------------------


def _qkv_groups(cfg: ModelConfig) -> tuple[int, int, int]:
    groups = cfg.num_key_value_heads
    return groups, cfg.num_attention_heads // groups * cfg.head_dim, cfg.head_dim


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig):
    """[q; k; v] (HF, head-major) -> megatron's per-KV-group [q_g; k_g; v_g] rows."""
    groups, q_rows, kv_rows = _qkv_groups(cfg)
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, q_rows, *rest),
        k.reshape(groups, kv_rows, *rest),
        v.reshape(groups, kv_rows, *rest),
    )
    return torch.cat(parts, dim=1).reshape(groups * (q_rows + 2 * kv_rows), *rest)


def qkv_to_hf(qkv: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    groups, q_rows, kv_rows = _qkv_groups(cfg)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, q_rows + 2 * kv_rows, *rest)
    q, k, v = torch.split(grouped, [q_rows, kv_rows, kv_rows], dim=1)
    return [
        q.reshape(groups * q_rows, *rest),
        k.reshape(groups * kv_rows, *rest),
        v.reshape(groups * kv_rows, *rest),
    ]


def _copy_in(mapping, entry, hf):
    return hf[0]


def _copy_out(mapping, entry, unit):
    return [unit]


def _qkv_in(mapping, entry, hf):
    return qkv_to_megatron(*hf, mapping.config)


def _qkv_out(mapping, entry, unit):
    return qkv_to_hf(unit, mapping.config)


def _gate_up_in(mapping, entry, hf):
    return torch.cat(hf, dim=0)


def _gate_up_out(mapping, entry, unit):
    return list(torch.chunk(unit, 2, dim=0))


def _vocab_in(mapping, entry, hf):
    rows = entry.shape[0] - hf[0].shape[0]
    if rows == 0:
        return hf[0]
    return torch.cat([hf[0], hf[0].new_zeros(rows, *hf[0].shape[1:])])


def _vocab_out(mapping, entry, unit):
    return [unit[: mapping.config.vocab_size]]


_TO_MEGATRON: dict[str, Callable] = {
    "copy": _copy_in,
    "qkv": _qkv_in,
    "gate_up": _gate_up_in,
    "vocab": _vocab_in,
}
_TO_HF: dict[str, Callable] = {
    "copy": _copy_out,
    "qkv": _qkv_out,
    "gate_up": _gate_up_out,
    "vocab": _vocab_out,
}


# -- the architectures ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One megatron key and the HF tensors of each of its units.

    `hf` are name templates ({layer}, {expert}); `per` says what the key stacks over (model:
    nothing, layer: [L], expert: [L, E]); `shape` gives the unit shape for a config. HF shapes
    follow from the unit shape through the transform.
    """

    key: str
    kind: str
    hf: tuple[str, ...]
    per: str
    shape: Callable[[ModelConfig], Shape]
    extra_state: bool = False  # a linear layer: megatron writes `_extra_state` per unit


_L = "decoder.layers."
_P = "model.layers.{layer}."
_X = "model.layers.{layer}.mlp.experts.{expert}."


def _rule(key, kind, hf, per, shape, extra_state=False) -> Rule:
    return Rule(key, kind, tuple(hf), per, shape, extra_state)


def _qkv_rows(c) -> int:
    return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim


EMBEDDING = _rule(
    "embedding.word_embeddings.weight", "vocab", ["model.embed_tokens.weight"], "model",
    lambda c: (c.padded_vocab_size(1), c.hidden_size),
)  # fmt: skip
ATTENTION = (
    _rule(_L + "self_attention.linear_qkv.layer_norm_weight", "copy",
          [_P + "input_layernorm.weight"], "layer", lambda c: (c.hidden_size,)),
    _rule(_L + "self_attention.linear_qkv.weight", "qkv",
          [_P + "self_attn.q_proj.weight", _P + "self_attn.k_proj.weight",
           _P + "self_attn.v_proj.weight"], "layer",
          lambda c: (_qkv_rows(c), c.hidden_size), extra_state=True),
    _rule(_L + "self_attention.linear_proj.weight", "copy", [_P + "self_attn.o_proj.weight"],
          "layer", lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
          extra_state=True),
    _rule(_L + "self_attention.q_layernorm.weight", "copy", [_P + "self_attn.q_norm.weight"],
          "layer", lambda c: (c.head_dim,)),
    _rule(_L + "self_attention.k_layernorm.weight", "copy", [_P + "self_attn.k_norm.weight"],
          "layer", lambda c: (c.head_dim,)),
)  # fmt: skip
MOE_MLP = (
    _rule(_L + "pre_mlp_layernorm.weight", "copy", [_P + "post_attention_layernorm.weight"],
          "layer", lambda c: (c.hidden_size,)),
    _rule(_L + "mlp.router.weight", "copy", [_P + "mlp.gate.weight"], "layer",
          lambda c: (c.num_experts, c.hidden_size)),
    _rule(_L + "mlp.experts.experts.linear_fc1.weight", "gate_up",
          [_X + "gate_proj.weight", _X + "up_proj.weight"], "expert",
          lambda c: (2 * c.moe_intermediate_size, c.hidden_size), extra_state=True),
    _rule(_L + "mlp.experts.experts.linear_fc2.weight", "copy", [_X + "down_proj.weight"],
          "expert", lambda c: (c.hidden_size, c.moe_intermediate_size), extra_state=True),
)  # fmt: skip
DENSE_MLP = (
    _rule(_L + "mlp.linear_fc1.layer_norm_weight", "copy",
          [_P + "post_attention_layernorm.weight"], "layer", lambda c: (c.hidden_size,)),
    _rule(_L + "mlp.linear_fc1.weight", "gate_up",
          [_P + "mlp.gate_proj.weight", _P + "mlp.up_proj.weight"], "layer",
          lambda c: (2 * c.intermediate_size, c.hidden_size), extra_state=True),
    _rule(_L + "mlp.linear_fc2.weight", "copy", [_P + "mlp.down_proj.weight"], "layer",
          lambda c: (c.hidden_size, c.intermediate_size), extra_state=True),
)  # fmt: skip
FINAL_NORM = _rule(
    "decoder.final_layernorm.weight", "copy", ["model.norm.weight"], "model",
    lambda c: (c.hidden_size,),
)  # fmt: skip
OUTPUT = _rule(
    HEAD_KEY, "vocab", [LM_HEAD_HF_NAME], "model",
    lambda c: (c.padded_vocab_size(1), c.hidden_size),
)  # fmt: skip
# A value / reward model's head (model.ValueHead): one row, replicated over TP, no padding.
VALUE_HEAD = _rule(
    HEAD_KEY, "copy", [VALUE_HEAD_HF_NAME], "model", lambda c: (1, c.hidden_size),
)  # fmt: skip


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.attention_bias:
        # HF Qwen3 puts a bias on q/k/v *and* o_proj; megatron's add_qkv_bias covers q/k/v only.
        raise ConversionError(
            "attention_bias=true is not supported (no Qwen3 release uses it; megatron has no "
            "o_proj bias for it)"
        )


def build_mapping(
    cfg: ModelConfig, layer_rules: Sequence[Rule], *, value_head: bool = False
) -> ModelMapping:
    """Units in HF file order: embedding, then each layer (experts in order), then the final
    norm and the (untied) output layer, or a value model's head."""
    _check_supported(cfg)
    # a value head is never tied to the embedding
    output = [VALUE_HEAD] if value_head else [] if cfg.tie_word_embeddings else [OUTPUT]
    head, tail = [EMBEDDING], [FINAL_NORM, *output]
    m = ModelMapping(cfg, value_head=value_head)
    layers, experts = cfg.num_hidden_layers, cfg.num_experts if cfg.is_moe else 0
    stacked = {"model": (), "layer": (layers,), "expert": (layers, experts)}
    for rule in (*head, *layer_rules, *tail):
        m.add_key(
            KeySpec(
                rule.key,
                stacked[rule.per],
                tuple(rule.shape(cfg)),
                vocab_padded=rule.kind == "vocab",
                extra_state=rule.extra_state,
            )
        )

    def add(rule: Rule, index: Shape, **fmt) -> None:
        spec = m.keys[rule.key]
        shapes = [
            tuple(t.shape)
            for t in _TO_HF[rule.kind](
                m, _meta_entry(rule, spec), torch.empty(spec.unit_shape, device="meta")
            )
        ]
        names = [name.format(**fmt) for name in rule.hf]
        m.add(rule.key, index, rule.kind, list(zip(names, shapes, strict=True)))

    for rule in head:
        add(rule, ())
    for layer in range(layers):
        for rule in layer_rules:
            if rule.per == "layer":
                add(rule, (layer,), layer=layer)
            else:
                for expert in range(experts):
                    add(rule, (layer, expert), layer=layer, expert=expert)
    for rule in tail:
        add(rule, ())
    return m


def _meta_entry(rule: Rule, spec: KeySpec) -> TensorMapping:
    return TensorMapping(rule.key, (), rule.hf, (), rule.kind, spec.unit_shape)


def qwen3_moe_mapping(cfg: ModelConfig, *, value_head: bool = False) -> ModelMapping:
    return build_mapping(cfg, (*ATTENTION, *MOE_MLP), value_head=value_head)


def qwen3_mapping(cfg: ModelConfig, *, value_head: bool = False) -> ModelMapping:
    return build_mapping(cfg, (*ATTENTION, *DENSE_MLP), value_head=value_head)


# HF `model_type` -> the mapping of that architecture (policy, or value model with value_head).
MAPPINGS: dict[str, Callable[..., ModelMapping]] = {
    "qwen3_moe": qwen3_moe_mapping,
    "qwen3": qwen3_mapping,
}


def get_mapping(cfg: ModelConfig, *, value_head: bool = False) -> ModelMapping:
    """The mapping for a model config — a policy's, or with `value_head` a value / reward
    model's (`output_layer.weight` <-> `score.weight`); a clear error for architectures without
    one."""
    builder = MAPPINGS.get(cfg.model_type)
    if builder is None:
        raise ConversionError(
            f"no checkpoint mapping for model_type={cfg.model_type!r} ({cfg.architecture}); "
            f"supported: {sorted(MAPPINGS)}"
        )
    return builder(cfg, value_head=value_head)


def is_value_head_shape(shape: Sequence[int] | None) -> bool:
    """Whether a stored `output_layer.weight` global shape is a value model's head ([1, hidden];
    a policy's is the padded vocabulary, or absent when tied)."""
    return shape is not None and len(shape) == 2 and shape[0] == 1


def sequence_classification_architecture(cfg: ModelConfig) -> str:
    """transformers' value / reward model class of an architecture (GenericForSequenceClassification
    over the same decoder): Qwen3MoeForCausalLM -> Qwen3MoeForSequenceClassification."""
    return cfg.architecture.removesuffix("ForCausalLM") + "ForSequenceClassification"


# Tensors an HF checkpoint may hold that carry no weights of ours (recomputed buffers).
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def unexpected_hf_names(
    mapping: ModelMapping, names: Sequence[str], *, ignore_heads: bool = False
) -> list[str]:
    """HF tensors the mapping has no place for (a tied `lm_head.weight` is allowed; with
    `ignore_heads`, any `lm_head.weight` or `score.weight`: a value model initialised from a
    checkpoint's transformer only)."""
    known = set(mapping.hf_names)
    out = []
    for name in names:
        if name in known or name.endswith(IGNORED_HF_SUFFIXES):
            continue
        if ignore_heads and name in (LM_HEAD_HF_NAME, VALUE_HEAD_HF_NAME):
            continue
        if (
            name == LM_HEAD_HF_NAME
            and mapping.config.tie_word_embeddings
            and not mapping.value_head
        ):
            continue  # some tied checkpoints store it; transformers ties it to the embedding
        out.append(name)
    return out
