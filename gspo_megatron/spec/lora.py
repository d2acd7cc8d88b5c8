"""LoRA adapters of the policy: the `lora` config section and the names of the layers it can
adapt (the megatron package builds them: its `lora` module; docs/LORA.md).

A target is a megatron-core linear layer by its module name: the attention's fused q/k/v
projection and output projection, the dense MLP's fc1 (gate and up, fused) and fc2 (down), and
the experts' fc1 and fc2 (each expert its own adapter). The router is never adapted: its
routes must stay those the rollout engine reproduces, and it is a layer of a few thousand
weights that LoRA would not shrink. `all-linear` (PEFT's name) is every target the model has.

`modules_to_save` (PEFT's name) trains whole weights beside the adapters: the vocabulary
projection, the final norm, the embedding. A model trained from random initialisation needs
them (its frozen output layer caps every logit), a pre-trained one rarely does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_megatron.config_fields import bounded

ATTENTION_TARGETS = ("attention.linear_qkv", "attention.linear_proj")
DENSE_MLP_TARGETS = ("mlp.linear_fc1", "mlp.linear_fc2")
EXPERT_TARGETS = ("experts.linear_fc1", "experts.linear_fc2")
ALL_LINEAR = "all-linear"
NEVER_ADAPTED = {
    "router": "the router is never adapted: its routes must stay the ones the rollout engine "
    "reproduces (and it has too few weights for LoRA to shrink)",
    "output_layer": "the vocabulary projection is not adapted (PEFT's all-linear leaves it out "
    "too); it trains only with full-parameter training",
    "embedding": "the embedding is not a linear layer LoRA adapts here",
}
# lora.modules_to_save: name -> megatron parameter name
SAVED_MODULES = {
    "output_layer": "output_layer.weight",
    "final_norm": "decoder.final_layernorm.weight",
    "embedding": "embedding.word_embeddings.weight",
}


@dataclass
class LoRASettings:
    """`lora`: low-rank adapters on the policy's linear layers, the base weights frozen
    (docs/LORA.md).

    rank: the adapters' rank r; null = full-parameter training (no adapters). alpha: the
    adapter's output is scaled by alpha / rank (PEFT's lora_alpha). dropout: on the adapter's
    input (PEFT's lora_dropout). targets: the layers' names (attention.linear_qkv,
    attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2, experts.linear_fc1,
    experts.linear_fc2) or all-linear (every one the model has). modules_to_save: whole
    weights trained beside the adapters (output_layer, final_norm, embedding; PEFT's
    modules_to_save).
    """

    rank: int | None = bounded(None, ge=1)
    alpha: float = bounded(32.0, gt=0)
    dropout: float = bounded(0.0, ge=0, lt=1)
    targets: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    modules_to_save: list[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def model_targets(is_moe: bool) -> tuple[str, ...]:
    """The targets a model has: attention everywhere, then experts (MoE) or the dense MLP."""
    return ATTENTION_TARGETS + (EXPERT_TARGETS if is_moe else DENSE_MLP_TARGETS)


def resolve_targets(targets: list[str], is_moe: bool, key: str = "lora.targets") -> frozenset:
    """The layer names `targets` adapt on a model (MoE or dense); a name that is not a target,
    a layer never adapted, or one the model does not have is refused, naming it."""
    have = model_targets(is_moe)
    if not targets:
        raise ValueError(f"{key} is empty: name the layers to adapt, or all-linear")
    chosen = set()
    for name in targets:
        if name == ALL_LINEAR:
            chosen.update(have)
        elif name in NEVER_ADAPTED:
            raise ValueError(f"{key} entry {name!r}: {NEVER_ADAPTED[name]}")
        elif name not in ATTENTION_TARGETS + DENSE_MLP_TARGETS + EXPERT_TARGETS:
            raise ValueError(
                f"{key} entry {name!r} is not a layer LoRA adapts: one of "
                f"{[*ATTENTION_TARGETS, *DENSE_MLP_TARGETS, *EXPERT_TARGETS, ALL_LINEAR]}"
            )
        elif name not in have:
            kind = (
                "a Mixture-of-Experts model has experts, no dense MLP"
                if is_moe
                else ("a dense model has a dense MLP, no experts")
            )
            raise ValueError(
                f"{key} entry {name!r} matches nothing in the model ({kind}); its layers are "
                f"{list(have)}"
            )
        else:
            chosen.add(name)
    return frozenset(chosen)


def resolve_modules_to_save(
    names: list[str], tied_embeddings: bool, key: str = "lora.modules_to_save"
) -> frozenset:
    """The whole weights `names` trains beside the adapters; an unknown name, or the output
    layer or embedding of a model that ties them (one weight, two names), is refused."""
    for name in names:
        if name not in SAVED_MODULES:
            raise ValueError(f"{key} entry {name!r} is not one of {list(SAVED_MODULES)}")
        if tied_embeddings and name in ("output_layer", "embedding"):
            raise ValueError(
                f"{key} entry {name!r} on a model with tie_word_embeddings=true (the output "
                "layer and the embedding are one weight) is not built yet"
            )
    return frozenset(names)
