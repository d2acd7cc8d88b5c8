"""`gspo_checkpoint.json`, the metadata file of gspo-megatron checkpoints: the one definition of
its format, read and written without importing megatron-core (converters, the Slurm preflight
and config checks use it before any process group exists).

Format 2 (current): model config, the layout it was saved on, optimizer steps done, whether
optimizer state is there, and the trainer's state (`extra`: step, data position). The directory
also holds `manifest.json` (gspo_megatron.checkpoint.manifest), written last. Format 1
checkpoints (no manifest, scheduler state in megatron's common state) load as initial weights
(`model.init_from`) but are not resumed: their integrity cannot be checked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gspo_megatron.files import write_atomically
from gspo_megatron.spec.model_config import ModelConfig

META_FILE = "gspo_checkpoint.json"
FORMAT_VERSION = 2
RESUMABLE_FORMATS = (2,)
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (or written); the message names the file and why."""


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{meta_file}: missing (not a gspo-megatron checkpoint, or an incomplete one)"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_file}: unreadable checkpoint metadata ({err})") from err
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{meta_file}: not gspo-megatron checkpoint metadata")
    return meta


def write_meta(path: str | Path, meta: dict[str, Any]) -> None:
    """Write the metadata durably (it is listed in the manifest written after it)."""
    meta_file = Path(path) / META_FILE
    write_atomically(meta_file, json.dumps({"format_version": FORMAT_VERSION, **meta}, indent=2))


def model_config_from_meta(meta_model: dict[str, Any], **overrides: Any) -> ModelConfig:
    values = dict(meta_model)
    values["mlp_only_layers"] = tuple(values.get("mlp_only_layers") or ())
    values.update(overrides)
    return ModelConfig(**values)


def step_of(path: str | Path) -> int | None:
    """The RL step of a run directory's checkpoint `step_NNNNNN`, else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def architecture_difference(saved: dict[str, Any], model: ModelConfig) -> str | None:
    """The first shape-defining field where a saved config differs from `model`, as a message."""
    mine = model.to_dict()
    for key in (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "intermediate_size",
        "tie_word_embeddings",
    ):
        if key in saved and saved[key] != mine[key] and (key != "num_experts" or model.is_moe):
            return (
                f"checkpoint has model.{key}={saved[key]!r} but the configured model has "
                f"{mine[key]!r}; pick the matching model preset or checkpoint"
            )
    return None


def lora_difference(saved: dict[str, Any] | None, mine: dict[str, Any] | None) -> str | None:
    """How the LoRA adapters a checkpoint holds (its metadata's `lora`: the `lora` section, or
    None for full weights) differ from an engine's, as a message; None when they match."""

    def describe(lora: dict[str, Any] | None) -> str:
        if not lora:
            return "no LoRA adapters (lora.rank=null)"
        return (
            f"LoRA adapters of lora.rank={lora['rank']}, lora.alpha={lora['alpha']:g}, "
            f"lora.targets={sorted(lora['targets'])}, "
            f"lora.modules_to_save={sorted(lora.get('modules_to_save', []))}"
        )

    def key(lora: dict[str, Any] | None):
        if not lora:
            return None
        saved = sorted(lora.get("modules_to_save", []))
        return (lora["rank"], float(lora["alpha"]), sorted(lora["targets"]), saved)

    if key(saved) == key(mine):
        return None
    return f"the checkpoint holds {describe(saved)}, the engine has {describe(mine)}"
