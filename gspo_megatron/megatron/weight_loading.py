"""Weights into megatron model chunks of any layout, from an HF directory or a megatron
checkpoint (what the directory holds is read by gspo_megatron.checkpoint.reading).

`load_hf_weights` needs no intermediate checkpoint: every rank walks its chunks'
`sharded_state_dict()` (the same layout-independent description dist_checkpointing uses), and
fills each local piece — a TP slice of layer 3's QKV, expert 17's fc1 on this EP rank — from
the HF tensors through the shared mapping, reading only what it needs. Value / reward models
(chunks built with `value_head=True`) take a `head` mode: "load" or "init"
(checkpoint/reading.py). `load_engine_weights` / `load_engine_hf_weights` do the same for a
TrainingEngine, inside its own parallel layout, and refresh its optimizer's master copies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)

from gspo_megatron.checkpoint.hf_io import HFCheckpoint, read_unit_rows, validate_hf_tensors
from gspo_megatron.checkpoint.mapping import HEAD_KEY, ConversionError, ModelMapping, get_mapping
from gspo_megatron.checkpoint.reading import (
    HEAD_MODES,
    check_megatron_head,
    is_hf_dir,
    is_megatron_dir,
    read_value_head,
)
from gspo_megatron.megatron import checkpointing
from gspo_megatron.megatron.lora import ADAPTER_PARAMETERS
from gspo_megatron.megatron.model import ValueHead
from gspo_megatron.spec.model_config import ModelConfig


def _check_head_mode(chunks, value_head: bool, head: str) -> None:
    if head not in HEAD_MODES:
        raise ValueError(f"head={head!r}: expected one of {HEAD_MODES}")
    if head == "init" and not value_head:
        raise ValueError(
            "head='init' initialises a value model's head (value_head=True); a policy's output "
            "layer is always loaded"
        )
    for chunk in chunks:
        layer = getattr(chunk, "output_layer", None)
        if layer is not None and isinstance(layer, ValueHead) != value_head:
            raise ValueError(
                f"value_head={value_head} but the model chunks were built "
                f"{'without' if value_head else 'with'} a value head (build_model_chunks / "
                "TrainingEngine value_head=)"
            )


class _WithoutHead:
    """A chunk as the megatron loader sees it with head="init": its sharded state dict without
    the output layer (so nothing is read for it) and a non-strict load_state_dict (so the
    head keeps its values)."""

    def __init__(self, chunk) -> None:
        self._chunk = chunk

    def sharded_state_dict(self) -> dict:
        prefix = HEAD_KEY.removesuffix("weight")
        state = self._chunk.sharded_state_dict()
        return {k: v for k, v in state.items() if not k.startswith(prefix)}

    def load_state_dict(self, state, strict: bool = False):
        return self._chunk.load_state_dict(state, strict=False)


ADAPTER_SUFFIXES = tuple(f".{name}" for name in ADAPTER_PARAMETERS)


class _WithoutAdapters:
    """A chunk with LoRA adapters as a loader of its base weights sees it: its sharded state
    dict without the adapters (so nothing is read for them) and a non-strict load_state_dict
    (so they keep their initialisation: B = 0, the base model exactly)."""

    def __init__(self, chunk) -> None:
        self._chunk = chunk

    def sharded_state_dict(self) -> dict:
        state = self._chunk.sharded_state_dict()
        return {k: v for k, v in state.items() if not k.endswith(ADAPTER_SUFFIXES)}

    def load_state_dict(self, state, strict: bool = False):
        return self._chunk.load_state_dict(state, strict=False)


def base_weights_of(chunks) -> list:
    """`chunks` as a loader of base weights sees them: those with LoRA adapters without them."""
    return [
        _WithoutAdapters(chunk)
        if any(name.endswith(ADAPTER_SUFFIXES) for name, _ in chunk.named_parameters())
        else chunk
        for chunk in chunks
    ]


def _local_sharded_tensors(node) -> Iterator:
    if isinstance(node, dict):
        for value in node.values():
            yield from _local_sharded_tensors(value)
    elif isinstance(node, list):
        for value in node:
            yield from _local_sharded_tensors(value)
    elif isinstance(node, ShardedTensorFactory):
        yield from _local_sharded_tensors(node.build())
    elif isinstance(node, ShardedTensor):
        yield node


def sharded_pieces(chunks, mapping: ModelMapping, *, main_replica_only: bool = False):
    """(entry, region offsets, ShardedTensor) for every weight piece this rank holds.

    The region is the piece's position inside its mapping unit (layer/expert axes removed).
    """
    for chunk in chunks:
        for sh in _local_sharded_tensors(chunk.sharded_state_dict()):
            if main_replica_only and not is_main_replica(sh.replica_id):
                continue
            spec = mapping.keys.get(sh.key)
            if spec is None:
                raise ConversionError(f"megatron tensor {sh.key} is not in the mapping")
            stacked = len(spec.stacked)
            if sh.flattened_range is not None or sh.prepend_axis_num != stacked:
                raise ConversionError(f"unsupported sharding of {sh.key} ({sh})")
            index = tuple(sh.global_offset[:stacked])
            yield mapping.unit(sh.key, index), tuple(sh.global_offset[stacked:]), sh


def load_hf_weights(
    chunks,
    model_config: ModelConfig,
    hf_dir: str | Path,
    *,
    value_head: bool = False,
    head: str = "load",
) -> None:
    """Fill this rank's model chunks (any layout) from an HF safetensors directory (the base
    weights of chunks with LoRA adapters, which stay as built).

    value_head: the chunks are a value / reward model's; head: "load" or "init" (module doc).
    """
    _check_head_mode(chunks, value_head, head)
    if value_head and head == "load":
        read_value_head(hf_dir)  # refuses num_labels != 1, naming config.json
    mapping = get_mapping(model_config, value_head=value_head)
    ckpt = HFCheckpoint(hf_dir)
    validate_hf_tensors(mapping, ckpt, head=head)
    with torch.no_grad():
        # head="init": the value head stays as built (the HF directory may be a policy's).
        skip = (HEAD_KEY,) if head == "init" else ()
        for _, _, sh, region in hf_regions(base_weights_of(chunks), mapping, ckpt, skip=skip):
            sh.data.copy_(region.reshape(sh.data.shape))


def hf_regions(
    chunks, mapping: ModelMapping, ckpt: HFCheckpoint, *, main_replica_only=False, skip=()
):
    """(entry, region offsets, ShardedTensor, the region's values read from `ckpt` in the
    megatron unit's layout) for every weight piece this rank holds (`sharded_pieces`): what
    loading an HF directory writes into each piece, and what an HF export is checked against.
    Pieces of the megatron keys in `skip` are left out, unread (`ckpt` may not hold them)."""
    cached: tuple[Any, torch.Tensor] | None = None
    for entry, offsets, sh in sharded_pieces(chunks, mapping, main_replica_only=main_replica_only):
        if entry.key in skip:
            continue
        shape = tuple(sh.local_shape)
        if entry.kind in ("copy", "vocab"):  # read only this piece's rows
            region = read_unit_rows(ckpt, entry, offsets[0], offsets[0] + shape[0])
            for dim in range(1, len(shape)):
                region = region.narrow(dim, offsets[dim], shape[dim])
        else:
            if cached is None or cached[0] is not entry:
                hf = [ckpt.read(n) for n in entry.hf_names]
                cached = (entry, mapping.to_megatron(entry, hf))
            region = cached[1]
            for dim, (start, length) in enumerate(zip(offsets, shape, strict=True)):
                region = region.narrow(dim, start, length)
        yield entry, offsets, sh, region


def load_weights(
    chunks,
    model_config: ModelConfig,
    path: str | Path,
    *,
    value_head: bool = False,
    head: str = "load",
) -> dict[str, Any]:
    """Weights from an HF directory or a megatron checkpoint (any layout, either layer spec)
    into this rank's chunks. Collective for megatron checkpoints. Returns checkpoint metadata.

    value_head: the chunks are a value / reward model's; head: "load" (the checkpoint must be
    a value model) or "init" (its transformer only; the head stays as built): see the module doc.
    Chunks with LoRA adapters get the base weights, their adapters left as built; a checkpoint
    that holds adapters is refused (megatron/checkpointing.py, load_model_weights).
    """
    path = Path(path)
    if is_hf_dir(path):
        load_hf_weights(chunks, model_config, path, value_head=value_head, head=head)
        return {"hf_config": json.loads((path / "config.json").read_text())}
    if is_megatron_dir(path):
        _check_head_mode(chunks, value_head, head)
        check_megatron_head(path, model_config, value_head, head)
        chunks = base_weights_of(chunks)  # LoRA adapters stay as built
        if head == "init":
            chunks = [_WithoutHead(chunk) for chunk in chunks]
        return checkpointing.load_model_weights(chunks, path, model_config)
    raise ConversionError(
        f"{path}: neither an HF model directory (config.json + *.safetensors) nor a megatron "
        "checkpoint (.metadata)"
    )


def load_engine_hf_weights(engine, hf_dir: str | Path) -> None:
    """Weights of an HF directory into a TrainingEngine on any layout (each rank reads only
    its shards); the optimizer's master copies are refreshed (a frozen engine's weights only)."""
    with engine.own_layout():
        load_hf_weights(engine.unwrapped_chunks, engine.model_config, hf_dir)
        _refresh_master_copies(engine)


def load_engine_weights(engine, path: str | Path, *, head: str = "load") -> dict:
    """Initial weights from an HF directory or a megatron checkpoint (converted or saved by
    training, any layout, either layer spec) into a TrainingEngine (a value model's from a
    value model's checkpoint, or with head="init" from a policy's, its head kept); returns
    the checkpoint's metadata. Collective for megatron checkpoints."""
    with engine.own_layout():
        meta = load_weights(
            engine.unwrapped_chunks,
            engine.model_config,
            path,
            value_head=engine.value_head,
            head=head,
        )
        _refresh_master_copies(engine)
    return meta


def _refresh_master_copies(engine) -> None:
    """The optimizer's fp32 copies from the loaded weights (a frozen engine has none)."""
    if engine.optimizer is not None:
        engine.optimizer.reload_model_params()
