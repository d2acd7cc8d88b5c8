"""LoRA adapters on megatron-core's column- and row-parallel linear layers (docs/LORA.md).

An adapted layer computes base(x) + alpha/r * B(A(x)) with the base weight frozen. Each layer
of the spec (`lora_layer_spec`) is replaced by a subclass holding its adapter as two more
parameters, `lora_a` [r, in] and `lora_b` [out, r], sharded like the base weight so that every
layout computes the unsharded adapter:

- column-parallel (q/k/v, fc1): B is split along the output with the weight, A is whole on every
  rank. The rank-r activation A(x) is what crosses ranks: summed over TP in the backward (no
  sequence parallelism), gathered along the sequence (with it), or left to the MoE token
  dispatcher, which already sums an expert's input gradients over expert-TP.
- row-parallel (attention out, fc2): A is split along the input with the weight, B is whole.
  The partial A(x) is summed over TP (or reduce-scattered along the sequence), or, in an
  expert, left partial like the expert's own output, which the dispatcher sums.

Where a replicated adapter weight sees only this rank's tokens or this rank's partial sum, its
gradient is summed over the layer's group as it is used (`_summed_gradient`), so every rank holds
the whole gradient, as megatron's DDP and optimizer expect of a replicated parameter.

B starts at zero (as PEFT does), so a fresh adapter leaves the model's outputs bitwise as they
are; A is drawn from a generator seeded by the run's seed and the layer's global name, the same
on every layout. Every other parameter of the model is frozen (`freeze_base`): megatron's DDP
and optimizer hold the adapters only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from gspo_megatron.checkpoint.lora_mapping import merged_weight
from gspo_megatron.spec.lora import SAVED_MODULES, LoRASettings

ADAPTER_PARAMETERS = ("lora_a", "lora_b")


def _summed_gradient(weight: torch.Tensor, group) -> torch.Tensor:
    """`weight` as it is; its gradient summed over `group` in the backward."""
    return copy_to_tensor_model_parallel_region(weight, group=group)


class _Adapter:
    """What both adapted layers share: the two adapter parameters, their scale, the switch
    that turns them off (`adapters_off`), and their checkpoint entries."""

    def _add_adapter(
        self, lora: LoRASettings, in_features: int, out_features: int, gated: bool
    ) -> None:
        weight = self.weight
        self.lora_scaling = lora.scaling
        self.lora_on = True
        # fc1 of a gated MLP: B's rows are [gate; up] on each rank, like the weight's
        self.lora_gated = gated and self.config.gated_linear_unit
        # Where megatron put the weight (the host under use_cpu_initialization, or the
        # accelerator); build_model_chunks then moves the chunk to device.accelerator().
        make = dict(dtype=weight.dtype, device=weight.device)
        self.lora_a = torch.nn.Parameter(torch.zeros(lora.rank, in_features, **make))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_features, lora.rank, **make))
        for param in (self.lora_a, self.lora_b):
            # experts' weights are reduced over expert-data-parallel ranks, not all of DP
            param.allreduce = getattr(weight, "allreduce", True)

    def effective_weight(self) -> torch.Tensor:
        """The weight this layer applies, for a forward without megatron's (the embedded
        engine's torch decoder): base + alpha/r * B @ A merged into a new tensor of the
        weight's dtype, outside autograd; the base weight itself when the adapters are off.
        On this rank's shard under tensor parallelism, like the weight."""
        if not self.lora_on:
            return self.weight
        with torch.no_grad():
            merged = merged_weight(self.weight, self.lora_a, self.lora_b, self.lora_scaling)
        return merged.to(self.weight.dtype)

    def _adapter_sharded_state_dict(
        self, out: dict, prefix: str, sharded_offsets, metadata, axis: dict
    ) -> dict:
        """`out` (the base layer's entries, which take every parameter as replicated) with the
        adapter's sharded along `axis`, B of a gated fc1 split into gate and up like its weight.
        """
        adapter = {name: getattr(self, name) for name in ADAPTER_PARAMETERS}
        entries = make_sharded_tensors_for_checkpoint(
            adapter,
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.lora_gated:
            key = f"{prefix}lora_b"
            entries[key] = apply_swiglu_sharded_factory(
                entries[key],
                sharded_offsets,
                metadata.get("singleton_local_shards", False),
                tp_group=self.tp_group,
                dp_group=metadata["dp_cp_group"],
            )
        out.update(entries)
        return out


class LoRAColumnParallelLinear(_Adapter, ColumnParallelLinear):
    """ColumnParallelLinear + a LoRA adapter: A whole, B split along the output like the weight."""

    def __init__(self, *args, lora: LoRASettings, gated: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.gather_output:
            raise ValueError("LoRA adapts column-parallel layers whose output stays split")
        self._add_adapter(lora, self.input_size, self.output_size_per_partition, gated)
        set_tensor_model_parallel_attributes(self.lora_b, True, 0, 1)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.lora_on:
            return output, bias
        group = self.tp_group
        if self.explicit_expert_comm:
            # An expert's input is whole here, and the dispatcher sums its gradient over
            # expert-TP; A sees this rank's share of the output only.
            hidden = F.linear(input_, _summed_gradient(self.lora_a, group))
        elif self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                F.linear(input_, _summed_gradient(self.lora_a, group)),
                tensor_parallel_output_grad=True,
                group=group,
            )
        else:
            hidden = copy_to_tensor_model_parallel_region(F.linear(input_, self.lora_a), group)
        return output + F.linear(hidden, self.lora_b) * self.lora_scaling, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._adapter_sharded_state_dict(
            out, prefix, sharded_offsets, metadata, {"lora_b": 0}
        )


class LoRARowParallelLinear(_Adapter, RowParallelLinear):
    """RowParallelLinear + a LoRA adapter: A split along the input like the weight, B whole."""

    def __init__(self, *args, lora: LoRASettings, gated: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("LoRA adapts row-parallel layers whose input is already split")
        self._add_adapter(lora, self.input_size_per_partition, self.output_size, gated)
        set_tensor_model_parallel_attributes(self.lora_a, True, 1, 1)

    def forward(self, input_):
        output, bias = super().forward(input_)
        if not self.lora_on:
            return output, bias
        group = self.tp_group
        partial = F.linear(input_, self.lora_a)
        if self.explicit_expert_comm:
            # The expert's output stays partial over expert-TP (the dispatcher sums it), and
            # so does B's share of it.
            delta = F.linear(partial, _summed_gradient(self.lora_b, group))
        elif self.sequence_parallel:
            hidden = reduce_scatter_to_sequence_parallel_region(partial, group=group)
            delta = F.linear(hidden, _summed_gradient(self.lora_b, group))
        else:
            delta = F.linear(reduce_from_tensor_model_parallel_region(partial, group), self.lora_b)
        return output + delta * self.lora_scaling, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._adapter_sharded_state_dict(
            out, prefix, sharded_offsets, metadata, {"lora_a": 1}
        )


ADAPTED_LAYERS = (LoRAColumnParallelLinear, LoRARowParallelLinear)


def lora_layer_spec(spec: ModuleSpec, lora: LoRASettings, targets: frozenset) -> ModuleSpec:
    """The decoder layer spec `spec` (megatron's local spec) with the layers named in `targets`
    (spec/lora.py) replaced by adapted ones."""
    sub = spec.submodules
    attention = sub.self_attention
    attn_sub = dataclasses.replace(
        attention.submodules,
        linear_qkv=_adapted(attention.submodules.linear_qkv, "attention.linear_qkv", lora, targets),
        linear_proj=_adapted(
            attention.submodules.linear_proj, "attention.linear_proj", lora, targets
        ),
    )
    mlp = sub.mlp  # functools.partial(MoELayer | MLP.as_mlp_submodule, submodules=...)
    mlp_sub = mlp.keywords["submodules"]
    if hasattr(mlp_sub, "experts"):  # MoESubmodules(experts=partial(SequentialMLP, ...))
        experts = mlp_sub.experts
        experts = _with_submodules(
            experts, _mlp_submodules(experts.keywords["submodules"], "experts", lora, targets)
        )
        mlp = _with_submodules(mlp, dataclasses.replace(mlp_sub, experts=experts))
    else:
        mlp = _with_submodules(mlp, _mlp_submodules(mlp_sub, "mlp", lora, targets))
    return dataclasses.replace(
        spec,
        submodules=dataclasses.replace(
            sub, self_attention=dataclasses.replace(attention, submodules=attn_sub), mlp=mlp
        ),
    )


def _with_submodules(builder: functools.partial, submodules) -> functools.partial:
    keywords = {**builder.keywords, "submodules": submodules}
    return functools.partial(builder.func, *builder.args, **keywords)


def _mlp_submodules(submodules, owner: str, lora: LoRASettings, targets: frozenset):
    return dataclasses.replace(
        submodules,
        linear_fc1=_adapted(submodules.linear_fc1, f"{owner}.linear_fc1", lora, targets, True),
        linear_fc2=_adapted(submodules.linear_fc2, f"{owner}.linear_fc2", lora, targets),
    )


def _adapted(layer, name: str, lora: LoRASettings, targets: frozenset, gated: bool = False):
    """`layer` (a linear layer's class) or, when `name` is a target, its adapted form."""
    if name not in targets:
        return layer
    for base, adapted in (
        (ColumnParallelLinear, LoRAColumnParallelLinear),
        (RowParallelLinear, LoRARowParallelLinear),
    ):
        if layer is base:
            return functools.partial(adapted, lora=lora, gated=gated)
    raise ValueError(
        f"lora.targets entry {name!r}: LoRA adapts megatron's local layers, not {layer}"
    )


def adapted_layers(chunks) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, layer) of every adapted layer of the model chunks."""
    for index, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, ADAPTED_LAYERS):
                yield f"chunk{index}.{name}", module


def freeze_base(chunks, modules_to_save: frozenset = frozenset()) -> None:
    """Every parameter but the adapters' and those of `modules_to_save` (spec/lora.py's
    names) stops training: no gradient, no optimizer state."""
    kept = {SAVED_MODULES[name] for name in modules_to_save}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.rsplit(".", 1)[-1] not in ADAPTER_PARAMETERS and name not in kept:
                param.requires_grad_(False)


def init_adapters(chunks, seed: int) -> None:
    """A as PEFT draws it (kaiming-uniform, a=sqrt(5): U(±1/sqrt(in))), from a generator seeded
    by `seed` and the layer's global name (global layer number, global expert index), drawn
    whole and then split, so that every layout starts from the same adapters; B = 0."""
    for chunk in chunks:
        for layer in chunk.modules():
            if not isinstance(layer, TransformerLayer):
                continue
            experts = _local_expert_offsets(layer)
            for name, module in layer.named_modules():
                if not isinstance(module, ADAPTED_LAYERS):
                    continue
                key = f"{seed}/layer{layer.layer_number}/{_global_expert_name(name, experts)}"
                _draw_a(module, zlib.crc32(key.encode()))
                with torch.no_grad():
                    module.lora_b.zero_()


def _local_expert_offsets(layer) -> int:
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if not isinstance(experts, SequentialMLP):
        return 0
    return parallel_state.get_expert_model_parallel_rank() * experts.num_local_experts


def _global_expert_name(name: str, offset: int) -> str:
    return re.sub(r"local_experts\.(\d+)", lambda m: f"expert{int(m[1]) + offset}", name)


def _draw_a(module, seed: int) -> None:
    a = module.lora_a
    rank, local_in = a.shape
    tp = module.tp_group.size()
    split = isinstance(module, LoRARowParallelLinear)
    full_in = local_in * tp if split else local_in
    bound = 1.0 / math.sqrt(full_in)
    generator = torch.Generator().manual_seed(seed)
    full = torch.empty(rank, full_in, dtype=torch.float32).uniform_(
        -bound, bound, generator=generator
    )
    if split:
        start = module.tp_group.rank() * local_in
        full = full[:, start : start + local_in]
    with torch.no_grad():
        a.copy_(full.to(a.dtype))


@contextlib.contextmanager
def adapters_off(chunks) -> Iterator[None]:
    """The base model: every adapter skipped for the block it encloses."""
    layers = [layer for _, layer in adapted_layers(chunks)]
    for layer in layers:
        layer.lora_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_on = True


class BaseModelReference:
    """The KL reference of a LoRA policy: the policy's own model with its adapters off, no
    second copy. It is the initial policy for the whole run, resumed or not: the base weights
    never train, and a fresh adapter (B = 0) adds exactly nothing.

    What the trainer asks of a reference: `forward` (routing replay included; nothing is
    recorded, so the policy's route metrics are untouched), `offload` / `reload` (nothing of
    its own to move: its weights are the policy's, which move with the policy) and `close`.
    """

    def __init__(self, policy) -> None:
        if policy.lora is None:
            raise ValueError("BaseModelReference needs a policy with LoRA adapters")
        self.policy = policy

    def forward(self, samples, **kwargs):
        with adapters_off(self.policy.unwrapped_chunks):
            return self.policy.forward(samples, **kwargs)

    def offload(self, what: str, *, keep_weights: bool) -> dict[str, float]:
        return {}

    def reload(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
