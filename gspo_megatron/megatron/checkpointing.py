"""Engine checkpoints with megatron dist_checkpointing: save on one layout, load on another.

A checkpoint directory holds one torch_dist checkpoint (model, and optionally optimizer and LR
scheduler), `gspo_checkpoint.json` (architecture, layout, step) and per-rank RNG states. It is
written under a temporary name and renamed when every rank has finished, so a directory with the
final name is always complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from gspo_megatron.megatron.model_config import ModelConfig

META_FILE = "gspo_checkpoint.json"
# megatron 0.19.2's default distributed-optimizer format ("fully_sharded_model_space") builds
# flattened_range shards that its own validator rejects; this one reshards across layouts.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def model_sharded_state_dict(chunks) -> dict:
    """Sharded state dicts of all model chunks; the sharded keys carry global layer numbers,
    so a checkpoint loads whatever the pipeline split."""
    return {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{meta_file}: not a gspo-megatron checkpoint (no {META_FILE})")
    try:
        return json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{meta_file}: unreadable checkpoint metadata ({err})") from err


def check_architecture(path: str | Path, model: ModelConfig) -> None:
    """Refuse a checkpoint of another architecture, naming the field that differs."""
    difference = architecture_difference(read_meta(path)["model"], model)
    if difference:
        raise CheckpointError(f"{path}: {difference}")


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


def save_engine(
    engine, path: str | Path, *, extra: dict[str, Any] | None = None, with_optimizer: bool = True
) -> Path:
    """Save model (+ optimizer, scheduler) and RNG state. Collective: call on every rank."""
    final = Path(path)
    if final.exists():
        raise CheckpointError(f"{final}: checkpoint directory already exists")
    tmp_name = _broadcast_str(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp = final.parent / tmp_name
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    _use_forked_results_queue()
    state = {"model": model_sharded_state_dict(engine.unwrapped_chunks)}
    if with_optimizer:
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            state["model"], metadata=_OPTIMIZER_METADATA
        )
        state["scheduler"] = engine.scheduler.state_dict()
        state["steps_done"] = engine.steps_done
    dist_checkpointing.save(state, str(tmp), async_sharded_save=False)
    rng_dir = tmp / "rng"
    if dist.get_rank() == 0:
        rng_dir.mkdir(exist_ok=True)
    dist.barrier()
    torch.save(_rng_state(), rng_dir / f"rank_{dist.get_rank():05d}.pt")
    if dist.get_rank() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "model": engine.model_config.to_dict(),
            "layout": dataclasses.asdict(engine.layout),
            "steps_done": engine.steps_done,
            "with_optimizer": with_optimizer,
            "extra": extra or {},
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(tmp, final)
    dist.barrier()
    return final


def load_engine(
    engine, path: str | Path, *, with_optimizer: bool = True, restore_rng: bool = True
) -> dict[str, Any]:
    """Load a checkpoint saved on any layout into `engine`; returns the metadata."""
    path = Path(path)
    meta = read_meta(path)
    check_architecture(path, engine.model_config)
    if with_optimizer and not meta.get("with_optimizer", False):
        raise CheckpointError(f"{path}: holds model weights only; load it with model.init_from")
    saved_ep = meta.get("layout", {}).get("ep", 1)
    if with_optimizer and saved_ep != engine.layout.ep:
        # megatron's optimizer state does not reshard between expert-parallel sizes.
        raise CheckpointError(
            f"{path}: optimizer state saved with parallel.ep={saved_ep} cannot be resumed with "
            f"parallel.ep={engine.layout.ep}; use the same ep, or start from the weights only "
            "(model.init_from)"
        )
    model_sd = model_sharded_state_dict(engine.unwrapped_chunks)
    state = {"model": model_sd}
    if with_optimizer:
        _ensure_optimizer_state(engine)
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=_OPTIMIZER_METADATA
        )
    loaded = _read(state, path)
    for i, chunk in enumerate(engine.unwrapped_chunks):
        chunk.load_state_dict(loaded["model"][f"chunk{i}"], strict=False)
    if with_optimizer:
        engine.optimizer.load_state_dict(loaded["optimizer"])
        _untie_adam_step(engine.optimizer)
        common = dist_checkpointing.load_common_state_dict(str(path))
        engine.scheduler.load_state_dict(common["scheduler"])
        engine.steps_done = int(common["steps_done"])
    else:
        # Keep the optimizer's master copies in step with the loaded weights.
        engine.optimizer.reload_model_params()
    if restore_rng:
        rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def _read(state: dict, path: Path) -> dict:
    """dist_checkpointing.load, with unreadable files reported as a CheckpointError.

    torch's CheckpointException derives from BaseException; it carries every rank's failure.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return dist_checkpointing.load(state, str(path))
    except CheckpointException as err:
        failures = getattr(err, "failures", {}) or {}
        first = next(iter(failures.values()), err)
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({type(first).__name__}: {first})"
        ) from None


def load_reference_weights(chunks, path: str | Path) -> list[dict[str, torch.Tensor]]:
    """The checkpoint's weights sharded like `chunks` (one dict per chunk), model untouched."""
    # dist_checkpointing loads into the given tensors in place: give it fresh ones.
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def detach(item):
        if isinstance(item, ShardedTensor):
            item.data = torch.empty_like(item.data)
        return item

    sharded = dict_list_map_inplace(detach, model_sharded_state_dict(chunks))
    loaded = dist_checkpointing.load({"model": sharded}, str(path))
    return [loaded["model"][f"chunk{i}"] for i in range(len(chunks))]


def _ensure_optimizer_state(engine) -> None:
    # A never-stepped megatron optimizer has no Adam state to load into (an assert on the
    # distributed optimizer, KeyError 'step' on the plain one). A step with zero gradients and
    # zero learning rate creates the state and changes no weight.
    inner = [getattr(o, "optimizer", None) for o in _sub_optimizers(engine.optimizer)]
    if all(opt is not None and len(opt.state) for opt in inner):
        return
    groups = engine.optimizer.param_groups
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in groups]
    for g in groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    for m in engine.model:
        m.zero_grad_buffer()
    engine.optimizer.zero_grad()
    engine.optimizer.step()
    for g, (lr, wd) in zip(groups, saved, strict=True):
        g["lr"] = lr
        g["weight_decay"] = wd


def _untie_adam_step(optimizer) -> None:
    # On the distributed optimizer's fallback path (no apex/TE), the loaded state can hand every
    # parameter the same `step` tensor; torch's foreach Adam then increments it once per
    # parameter and resumed runs drift. Give each parameter its own copy.
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        seen: set[int] = set()
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(state["step"]))


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _use_forked_results_queue() -> None:
    # The torch_dist writer collects results through a multiprocessing Manager it starts with
    # `spawn`: ~10 s per process, and the child re-imports the caller's __main__. A manager
    # started with `fork` is ready at once and runs no user code.
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = multiprocessing.get_context("fork").Manager()
        filesystem_async._results_queue = manager.Queue()


def _broadcast_str(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def remove_incomplete(parent: str | Path) -> list[Path]:
    """Delete leftovers of interrupted saves (`*.tmp-*` directories) under `parent`."""
    removed = []
    for child in Path(parent).glob("*.tmp-*"):
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


# -- model weights for either layer spec (added for gspo_megatron.checkpoint) ------------------

EXTRA_STATE_SUFFIX = "._extra_state"


def checkpoint_entry_names(path: str | Path) -> set[str]:
    """Names stored in a torch_dist checkpoint: tensor keys and ShardedObject unique keys."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a torch_dist checkpoint (no .metadata file)")
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def drop_missing_extra_state(sharded_state_dict: dict, stored: set[str], path: str | Path = ""):
    """The sharded state dict without the `_extra_state` objects the checkpoint lacks.

    transformer-engine modules keep FP8 metadata in `_extra_state` (norms included); the local
    spec and checkpoints converted from Hugging Face have none for some modules, and a module
    keeps its default when none is loaded. Any other entry the checkpoint lacks raises
    CheckpointError naming it. Returns (filtered dict, skipped unique keys).
    """
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    skipped: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                kept = walk(value)
                if kept is not _DROP:
                    out[key] = kept
            return out
        if isinstance(node, list):
            return [x for x in (walk(v) for v in node) if x is not _DROP]
        if isinstance(node, ShardedObject):
            if node.unique_key in stored:
                return node
            if node.key.endswith(EXTRA_STATE_SUFFIX):
                skipped.append(node.unique_key)
                return _DROP
            raise CheckpointError(f"{path}: checkpoint has no object {node.unique_key}")
        if isinstance(node, ShardedTensor | ShardedTensorFactory) and node.key not in stored:
            raise CheckpointError(f"{path}: checkpoint has no tensor {node.key}")
        return node

    return walk(sharded_state_dict), skipped


_DROP = object()


def load_model_weights(chunks, path: str | Path, model_config: ModelConfig | None = None):
    """Model weights from a checkpoint of any layout into `chunks`, for either layer spec.

    Like load_engine(..., with_optimizer=False) for the model, but it also accepts checkpoints
    converted from Hugging Face or written with the other layer spec: `_extra_state` objects the
    checkpoint lacks are skipped (see drop_missing_extra_state); a missing weight raises. When
    the chunks belong to a TrainingEngine, call `engine.optimizer.reload_model_params()` after.
    Returns the checkpoint's gspo metadata ({} for a plain megatron checkpoint). Collective.
    """
    path = Path(path)
    meta = read_meta(path) if is_checkpoint(path) else {}
    if meta and model_config is not None:
        check_architecture(path, model_config)
    sharded, _ = drop_missing_extra_state(
        model_sharded_state_dict(chunks), checkpoint_entry_names(path), path
    )
    loaded = dist_checkpointing.load({"model": sharded}, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"][f"chunk{i}"], strict=False)
    return meta
