"""`gspo_checkpoint.json`, the metadata file of gspo-megatron checkpoints, read and written
without importing megatron-core (so the converters start in seconds).

The same file and format version as `gspo_megatron.megatron.checkpointing` (a test holds them
equal): the model config, the layout it was saved on, steps, whether optimizer state is there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gspo_megatron.checkpoint.mapping import ConversionError
from gspo_megatron.megatron.model_config import ModelConfig

META_FILE = "gspo_checkpoint.json"
FORMAT_VERSION = 1


def is_gspo_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_gspo_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / META_FILE
    try:
        return json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{meta_file}: not a gspo-megatron checkpoint") from None
    except json.JSONDecodeError as err:
        raise ConversionError(f"{meta_file}: unreadable checkpoint metadata ({err})") from err


def model_config_from_meta(meta_model: dict[str, Any], **overrides: Any) -> ModelConfig:
    values = dict(meta_model)
    values["mlp_only_layers"] = tuple(values.get("mlp_only_layers") or ())
    values.update(overrides)
    return ModelConfig(**values)
