"""What a checkpoint directory holds, read from its files without building a model: an HF
directory or a megatron checkpoint, its architecture, whether its head is a policy's or a value
model's, and the refusals that need no model (`check_head`). Loading the weights into model
chunks is the training engine's side: gspo_megatron.megatron.weight_loading.

Value / reward models are loaded with one of two `head` modes, chosen by the caller, never by
what the checkpoint holds:

- "load": the checkpoint is a value model (HF `*ForSequenceClassification` with `score.weight`
  [1, hidden]; a megatron checkpoint whose `output_layer.weight` is [1, hidden]); a policy
  checkpoint is refused naming the file and tensor;
- "init": the transformer's weights only, from any checkpoint (policy or value model); the
  checkpoint's head (`lm_head` / `score` / `output_layer`) is ignored and the model's head is
  left as built (zeros). That is how a critic starts from the policy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gspo_megatron.checkpoint.hf_io import (
    HFCheckpoint,
    check_hf_head,
    read_hf_config,
    value_head_of,
)
from gspo_megatron.checkpoint.mapping import (
    HEAD_KEY,
    ConversionError,
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


def check_megatron_head(path: Path, model_config: ModelConfig, value_head: bool, head: str):
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
        check_megatron_head(path, model_config, value_head, head)
