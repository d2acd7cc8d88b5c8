"""What a LoRA policy sends to a rollout engine: its base weights, its adapters, or both merged.

`LoRAWeightSource` holds two `MegatronWeightSource`s over the same chunks, gathered from any
layout like the full weights are (megatron/weight_export.py):

  * `base`: the frozen base weights under their HF names (the chunks seen without adapters);
  * `adapters`: the adapters under HF PEFT names (checkpoint/lora_mapping.py), r * (in + out)
    numbers per adapted layer instead of in * out;
  * `trained`: whole weights trained beside the adapters (parameters that take gradients and are
    no adapters: PEFT's modules_to_save), under their HF names; None when there are none. An
    engine that keeps the base must take these with the adapters at every update.

As a `WeightSource` itself (`buckets`) it yields the merged weights, base + alpha/r * B @ A, for
engines that take whole models (SGLang with rollout.sglang.lora_sync=merged) and for the
Hugging Face export beside each checkpoint (megatron/hf_export.py, which gathers its buckets to
several ranks: `owners`). `EffectiveWeights` reads the same merged values off the live layers
(`effective_weight()`), piece by piece, for that export's read-back check. The generator
process (rollout/embedded/generator.py) takes the base once and the adapters at every update;
SGLang with lora_sync=adapter loads the adapters through its LoRA API (docs/LORA.md, "Weight
sync").
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from gspo_megatron.checkpoint.lora_mapping import LORA_A, LORA_B, adapter_mapping, merge_adapters
from gspo_megatron.checkpoint.mapping import ModelMapping, Shape, get_mapping
from gspo_megatron.megatron.lora import adapted_layers
from gspo_megatron.megatron.weight_export import MegatronWeightSource
from gspo_megatron.megatron.weight_loading import ADAPTER_SUFFIXES, base_weights_of
from gspo_megatron.spec.lora import LoRASettings
from gspo_megatron.spec.model_config import ModelConfig


class _AdaptersOnly:
    """A chunk as the adapters' export sees it: its sharded state dict's adapters alone."""

    def __init__(self, chunk) -> None:
        self._chunk = chunk

    def sharded_state_dict(self) -> dict:
        state = self._chunk.sharded_state_dict()
        return {k: v for k, v in state.items() if k.endswith(ADAPTER_SUFFIXES)}


class _TrainedWeightsOnly:
    """A chunk as the export of its trained whole weights sees it: the sharded state dict's
    tensors over parameters that take gradients, adapters aside."""

    def __init__(self, chunk) -> None:
        self._chunk = chunk
        self._trained = {
            p.data_ptr()
            for name, p in chunk.named_parameters()
            if p.requires_grad and not name.endswith(ADAPTER_SUFFIXES)
        }

    def sharded_state_dict(self) -> dict:
        state = self._chunk.sharded_state_dict()
        return {
            k: v
            for k, v in state.items()
            if isinstance(v, ShardedTensor)
            and not k.endswith(ADAPTER_SUFFIXES)
            and v.data.data_ptr() in self._trained
        }


def _trained_keys(chunks) -> list[str]:
    """The sharded keys of the trained whole weights on every rank (collective)."""
    mine = sorted(
        {v.key for c in chunks for v in _TrainedWeightsOnly(c).sharded_state_dict().values()}
    )
    if not dist.is_initialized():
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({key for part in every for key in part})


def _subset(mapping: ModelMapping, keys: list[str]) -> ModelMapping:
    """`mapping` with the units of `keys` only."""
    out = ModelMapping(mapping.config, value_head=mapping.value_head)
    for key in keys:
        out.add_key(mapping.keys[key])
    for entry in mapping.entries:
        if entry.key in keys:
            hf = list(zip(entry.hf_names, entry.hf_shapes, strict=True))
            out.add(entry.key, entry.index, entry.kind, hf)
    return out


class LoRAWeightSource:
    """A LoRA policy's weights for a rollout engine (see the module's docstring)."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        model_config: ModelConfig,
        lora: LoRASettings,
        *,
        dtype: torch.dtype | None = None,
        sender: int = 0,
    ) -> None:
        self.lora = lora
        self.scaling = lora.scaling
        self.base = MegatronWeightSource(
            base_weights_of(chunks), model_config, dtype=dtype, sender=sender
        )
        self.adapters = MegatronWeightSource(
            [_AdaptersOnly(c) for c in chunks],
            model_config,
            dtype=dtype,
            sender=sender,
            mapping=adapter_mapping(model_config, lora),
        )
        keys = _trained_keys(chunks)  # collective: every rank builds the source
        self.trained = None
        if keys:
            self.trained = MegatronWeightSource(
                [_TrainedWeightsOnly(c) for c in chunks],
                model_config,
                dtype=dtype,
                sender=sender,
                mapping=_subset(get_mapping(model_config), keys),
            )

    def updates(self) -> list[MegatronWeightSource]:
        """What changes between two versions: the adapters, and the trained whole weights."""
        return [self.adapters, *([self.trained] if self.trained is not None else [])]

    @classmethod
    def from_engine(cls, engine, *, dtype: torch.dtype | None = None) -> LoRAWeightSource:
        """The weights of a TrainingEngine with adapters (`engine.lora`)."""
        return cls(engine.unwrapped_chunks, engine.model_config, engine.lora, dtype=dtype)

    def is_sender(self) -> bool:
        return self.base.is_sender()

    def hf_shapes(self) -> dict[str, Shape]:
        """The merged model's tensors (the base's names and shapes)."""
        return self.base.hf_shapes()

    def plan(self, bucket_bytes: int) -> list[list[tuple[str, Shape, torch.dtype]]]:
        """The merged weights' buckets: the base's (MegatronWeightSource.plan)."""
        return self.base.plan(bucket_bytes)

    def buckets(
        self, bucket_bytes: int, owners: Sequence[int] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The merged weights, in the base's buckets, on the sender (or on `owners[b]` for
        bucket b of `plan`). Each receiver first gathers the adapters of the base weights it
        receives (a few percent of the model at the ranks LoRA is run with), then merges each
        base bucket as it arrives. Collective, like MegatronWeightSource.buckets."""
        adapters = self._adapters_for(bucket_bytes, owners)
        for bucket in self.base.buckets(bucket_bytes, owners):
            merged = merge_adapters(dict(bucket), adapters, self.scaling)
            yield [(name, merged[name]) for name, _ in bucket]

    def _adapters_for(self, bucket_bytes: int, owners: Sequence[int] | None) -> dict:
        """The adapter tensors this rank needs to merge the base buckets it receives: every
        one on the sender; with `owners`, those of its own buckets' weights, the adapters being
        gathered once to each receiving rank. Collective."""
        if owners is None:
            return dict(self.adapter_tensors(bucket_bytes))
        rank = dist.get_rank()
        plan = self.base.plan(bucket_bytes)
        mine = {
            name
            for owner, bucket in zip(owners, plan, strict=True)
            if owner == rank
            for name, _, _ in bucket
        }
        count = len(self.adapters.plan(bucket_bytes))
        out = {}
        for receiver in sorted(set(owners)):
            for bucket in self.adapters.buckets(bucket_bytes, [receiver] * count):
                for name, tensor in bucket:
                    module = name.removesuffix(LORA_A).removesuffix(LORA_B)
                    if f"{module}.weight" in mine:
                        out[name] = tensor
        return out

    def adapter_tensors(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Every adapter tensor by PEFT name (the sender; nothing elsewhere). Collective."""
        for bucket in self.adapters.buckets(bucket_bytes):
            yield from bucket


class EffectiveWeights:
    """The weights a LoRA policy applies, read off its live layers: `of(data)` maps a base
    weight's sharded-state-dict data (the weight, or a view of it such as a gated fc1's gate
    or up half) to the same view of its layer's `effective_weight()` (base + alpha/r * B @ A on
    this rank's shard); any other tensor is returned as it is. One layer's merged weight is held
    at a time (the pieces of a layer come together)."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self._layers = sorted(
            ((layer.weight.data_ptr(), layer) for _, layer in adapted_layers(chunks)),
            key=lambda item: item[0],
        )
        self._starts = [start for start, _ in self._layers]
        self._cached: tuple[object, torch.Tensor] | None = None

    def of(self, data: torch.Tensor) -> torch.Tensor:
        layer = self._layer_holding(data)
        if layer is None:
            return data
        if self._cached is None or self._cached[0] is not layer:
            self._cached = (layer, layer.effective_weight().contiguous())
        merged = self._cached[1]
        offset = (data.data_ptr() - layer.weight.data_ptr()) // data.element_size()
        return merged.as_strided(data.shape, data.stride(), offset)

    def _layer_holding(self, data: torch.Tensor):
        at = bisect.bisect_right(self._starts, data.data_ptr()) - 1
        if at < 0:
            return None
        start, layer = self._layers[at]
        weight = layer.weight
        if data.data_ptr() >= start + weight.numel() * weight.element_size():
            return None
        if not weight.is_contiguous() or data.dtype != weight.dtype:
            raise RuntimeError(
                f"{type(layer).__name__}: a non-contiguous weight, or a view of another dtype, "
                "cannot be matched to its merged value"
            )
        return layer


class LoRAAdapterSource:
    """The adapters alone as a `WeightSource` (SGLang with rollout.sglang.lora_sync=adapter):
    `buckets` yields the PEFT-named adapter tensors (without PEFT's `base_model.model.`
    prefix), `peft_config` PEFT's adapter_config.json of them. The servers hold the base."""

    def __init__(self, weights: LoRAWeightSource, model_config: ModelConfig) -> None:
        from dataclasses import asdict

        from gspo_megatron.checkpoint import lora_export

        self.weights = weights
        settings = asdict(weights.lora)
        adapted = lora_export.adapted_weight_keys(settings, model_config.is_moe)
        self.peft_config = lora_export.adapter_config(
            settings, adapted, get_mapping(model_config), None
        )

    @classmethod
    def from_engine(cls, engine) -> LoRAAdapterSource:
        return cls(LoRAWeightSource.from_engine(engine), engine.model_config)

    def is_sender(self) -> bool:
        return self.weights.is_sender()

    def hf_shapes(self) -> dict[str, Shape]:
        return self.weights.adapters.hf_shapes()

    def buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The adapters' buckets (collective; the sender's hold the tensors)."""
        return self.weights.adapters.buckets(bucket_bytes)
