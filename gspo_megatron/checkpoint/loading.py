"""Load policy weights into megatron model chunks of any layout, from an HF directory or a
megatron checkpoint, and read the architecture of either.

`load_hf_weights` needs no intermediate checkpoint: every rank walks its chunks'
`sharded_state_dict()` (the same layout-independent description dist_checkpointing uses), and
fills each local piece — a TP slice of layer 3's QKV, expert 17's fc1 on this EP rank — from
the HF tensors through the shared mapping, reading only what it needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gspo_megatron.checkpoint.hf_io import (
    HFCheckpoint,
    read_hf_config,
    read_unit_rows,
    validate_hf_tensors,
)
from gspo_megatron.checkpoint.mapping import ConversionError, ModelMapping, get_mapping
from gspo_megatron.checkpoint.meta import (
    META_FILE,
    is_checkpoint,
    model_config_from_meta,
    read_meta,
)
from gspo_megatron.megatron import checkpointing
from gspo_megatron.spec.model_config import ModelConfig


def is_hf_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def is_megatron_dir(path: str | Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def read_model_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """The architecture of an HF directory or a gspo megatron checkpoint."""
    path = Path(path)
    if is_hf_dir(path):
        return read_hf_config(path, **overrides)[0]
    if is_checkpoint(path):
        return model_config_from_meta(read_meta(path)["model"], **overrides)
    if is_megatron_dir(path):
        raise ConversionError(
            f"{path}: megatron checkpoint without {META_FILE}; give the model's "
            "HF config.json (--hf-config) to describe its architecture"
        )
    raise ConversionError(
        f"{path}: neither an HF model directory (config.json + *.safetensors) nor a megatron "
        "checkpoint (.metadata)"
    )


def _local_sharded_tensors(node) -> Iterator:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

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
    from megatron.core.dist_checkpointing.mapping import is_main_replica

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


def load_hf_weights(chunks, model_config: ModelConfig, hf_dir: str | Path) -> None:
    """Fill this rank's model chunks (any layout) from an HF safetensors directory."""
    mapping = get_mapping(model_config)
    ckpt = HFCheckpoint(hf_dir)
    validate_hf_tensors(mapping, ckpt)
    cached: tuple[Any, torch.Tensor] | None = None
    with torch.no_grad():
        for entry, offsets, sh in sharded_pieces(chunks, mapping):
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
            sh.data.copy_(region.reshape(sh.data.shape))


def load_weights(chunks, model_config: ModelConfig, path: str | Path) -> dict[str, Any]:
    """Weights from an HF directory or a megatron checkpoint (any layout, either layer spec)
    into this rank's chunks. Collective for megatron checkpoints. Returns checkpoint metadata.
    """
    path = Path(path)
    if is_hf_dir(path):
        load_hf_weights(chunks, model_config, path)
        return {"hf_config": json.loads((path / "config.json").read_text())}
    if is_megatron_dir(path):
        return checkpointing.load_model_weights(chunks, path, model_config)
    raise ConversionError(
        f"{path}: neither an HF model directory (config.json + *.safetensors) nor a megatron "
        "checkpoint (.metadata)"
    )
