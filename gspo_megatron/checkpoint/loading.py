"""Load policy or value-model weights into megatron model chunks of any layout, from an HF
directory or a megatron checkpoint, and read the architecture of either.

`load_hf_weights` needs no intermediate checkpoint: every rank walks its chunks'
`sharded_state_dict()` (the same layout-independent description dist_checkpointing uses), and
fills each local piece — a TP slice of layer 3's QKV, expert 17's fc1 on this EP rank — from
the HF tensors through the shared mapping, reading only what it needs.

Value / reward models (chunks built with `value_head=True`) are loaded with `value_head=True`
and one of two `head` modes, chosen by the caller, never by what the checkpoint holds:

- "load": the checkpoint is a value model (HF `*ForSequenceClassification` with `score.weight`
  [1, hidden]; a megatron checkpoint whose `output_layer.weight` is [1, hidden]); a policy
  checkpoint is refused naming the file and tensor;
- "init": the transformer's weights only, from any checkpoint (policy or value model); the
  checkpoint's head (`lm_head` / `score` / `output_layer`) is ignored and the chunks' head is
  left as built (`model.ValueHead`: zeros). That is how a critic starts from the policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gspo_megatron.checkpoint.hf_io import (
    HFCheckpoint,
    check_hf_head,
    read_hf_config,
    read_unit_rows,
    validate_hf_tensors,
    value_head_of,
)
from gspo_megatron.checkpoint.mapping import (
    HEAD_KEY,
    ConversionError,
    ModelMapping,
    get_mapping,
    is_value_head_shape,
)
from gspo_megatron.checkpoint.meta import (
    META_FILE,
    is_checkpoint,
    model_config_from_meta,
    read_meta,
)
from gspo_megatron.checkpoint.safe_load import read_dcp_metadata
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


HEAD_MODES = ("load", "init")


def stored_head_shape(path: str | Path) -> tuple[int, ...] | None:
    """The global shape of a megatron checkpoint's `output_layer.weight` ([1, hidden]: a value
    model's head; [padded vocab, hidden]: a policy's), None when absent (a tied policy). The
    metadata is read without running code (safe_load)."""
    md = read_dcp_metadata(path).state_dict_metadata.get(HEAD_KEY)
    size = getattr(md, "size", None)
    return None if size is None else tuple(size)


def read_value_head(path: str | Path) -> bool:
    """Whether an HF directory (its config's `architectures`) or a megatron checkpoint (its
    head's stored shape) holds a value / reward model rather than a policy."""
    path = Path(path)
    if is_hf_dir(path):
        config_file = path / "config.json"
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ConversionError(f"{config_file}: not valid JSON ({err})") from err
        return value_head_of(raw, str(config_file))
    if is_megatron_dir(path):
        return is_value_head_shape(stored_head_shape(path))
    raise ConversionError(
        f"{path}: neither an HF model directory (config.json + *.safetensors) nor a megatron "
        "checkpoint (.metadata)"
    )


def _check_head_mode(chunks, value_head: bool, head: str) -> None:
    if head not in HEAD_MODES:
        raise ValueError(f"head={head!r}: expected one of {HEAD_MODES}")
    if head == "init" and not value_head:
        raise ValueError(
            "head='init' initialises a value model's head (value_head=True); a policy's output "
            "layer is always loaded"
        )
    from gspo_megatron.megatron.model import ValueHead

    for chunk in chunks:
        layer = getattr(chunk, "output_layer", None)
        if layer is not None and isinstance(layer, ValueHead) != value_head:
            raise ValueError(
                f"value_head={value_head} but the model chunks were built "
                f"{'without' if value_head else 'with'} a value head (build_model_chunks / "
                "TrainingEngine value_head=)"
            )


def _check_megatron_head(path: Path, model_config: ModelConfig, value_head: bool, head: str):
    """The same refusals as for HF directories, from the stored head's shape: a policy
    checkpoint loaded as a value model (head="load"), a value model loaded as a policy.
    (megatron loads `output_layer.weight` with allow_shape_mismatch, so it would not object.)"""
    if head == "init":
        return
    shape = stored_head_shape(path)
    stored_value = is_value_head_shape(shape)
    if value_head and not stored_value:
        held = f"no {HEAD_KEY}" if shape is None else f"{HEAD_KEY} of global shape {list(shape)}"
        raise ConversionError(
            f"{path}: {held}, not a value head [1, {model_config.hidden_size}]: a policy "
            "checkpoint. To initialise a value model from a policy, load it with head='init' "
            "(the head starts at zero)"
        )
    if not value_head and stored_value:
        raise ConversionError(
            f"{path}: {HEAD_KEY} has global shape {list(shape)}: a value / reward model "
            "checkpoint, not a policy; load it as a value model"
        )


def check_head(
    path: str | Path, model_config: ModelConfig, *, value_head: bool, head: str = "load"
) -> None:
    """The refusals of `load_weights` that need no model (cheap: headers and metadata only):
    a policy checkpoint loaded as a value model with head="load", a value model loaded as a
    policy, num_labels != 1. Call it before building a large model."""
    if head not in HEAD_MODES:
        raise ValueError(f"head={head!r}: expected one of {HEAD_MODES}")
    path = Path(path)
    if is_hf_dir(path):
        if value_head and head == "load":
            read_value_head(path)
        check_hf_head(
            get_mapping(model_config, value_head=value_head), HFCheckpoint(path), head=head
        )
    elif is_megatron_dir(path):
        _check_megatron_head(path, model_config, value_head, head)


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


ADAPTER_SUFFIXES = (".lora_a", ".lora_b")  # megatron/lora.py's adapter parameters


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


def has_adapters(chunks) -> bool:
    return any(
        name.endswith(ADAPTER_SUFFIXES) for chunk in chunks for name, _ in chunk.named_parameters()
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


def load_hf_weights(
    chunks,
    model_config: ModelConfig,
    hf_dir: str | Path,
    *,
    value_head: bool = False,
    head: str = "load",
) -> None:
    """Fill this rank's model chunks (any layout) from an HF safetensors directory.

    value_head: the chunks are a value / reward model's; head: "load" or "init" (module doc).
    """
    _check_head_mode(chunks, value_head, head)
    if value_head and head == "load":
        read_value_head(hf_dir)  # refuses num_labels != 1, naming config.json
    mapping = get_mapping(model_config, value_head=value_head)
    ckpt = HFCheckpoint(hf_dir)
    validate_hf_tensors(mapping, ckpt, head=head)
    cached: tuple[Any, torch.Tensor] | None = None
    with torch.no_grad():
        for entry, offsets, sh in sharded_pieces(chunks, mapping):
            if head == "init" and entry.key == HEAD_KEY:
                continue  # the value head stays as built
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
    if has_adapters(chunks):  # base weights under LoRA adapters: the adapters stay as built
        chunks = [_WithoutAdapters(chunk) for chunk in chunks]
    if is_hf_dir(path):
        load_hf_weights(chunks, model_config, path, value_head=value_head, head=head)
        return {"hf_config": json.loads((path / "config.json").read_text())}
    if is_megatron_dir(path):
        _check_head_mode(chunks, value_head, head)
        _check_megatron_head(path, model_config, value_head, head)
        if head == "init":
            chunks = [_WithoutHead(chunk) for chunk in chunks]
        from gspo_megatron.megatron import checkpointing

        return checkpointing.load_model_weights(chunks, path, model_config)
    raise ConversionError(
        f"{path}: neither an HF model directory (config.json + *.safetensors) nor a megatron "
        "checkpoint (.metadata)"
    )
