"""Hugging Face <-> megatron-core checkpoints for Qwen3-MoE and dense Qwen3.

- `mapping`: the one name/layout mapping (megatron sharded keys <-> HF names), shared with the
  rollout side's weight export (`gspo_megatron.megatron.weight_export`);
- `convert`: `convert_hf_to_megatron`, `convert_megatron_to_hf` (streamed, staged output);
- `loading`: HF directory or megatron checkpoint -> model chunks of any layout;
- `torch_dist`, `hf_io`: the two file formats, read and written tensor by tensor;
- `verify`: log-probs of transformers vs megatron on random tokens;
- `logprobs_cli`: the `gspo-logprobs` console script.

See docs/CHECKPOINTS.md. Modules that touch megatron import it on use; `mapping` does not.
"""

from __future__ import annotations

from pathlib import Path


def load_hf_weights(engine, hf_dir: str | Path) -> None:
    """Weights of an HF directory into a TrainingEngine on any layout (each rank reads only
    its shards); the optimizer's master copies are refreshed (a frozen engine's weights only)."""
    from gspo_megatron.checkpoint.loading import load_hf_weights as load

    with engine.own_layout():
        load(engine.unwrapped_chunks, engine.model_config, hf_dir)
        _refresh_master_copies(engine)


def load_engine_weights(engine, path: str | Path, *, head: str = "load") -> dict:
    """Initial weights from an HF directory or a megatron checkpoint (converted or saved by
    training, any layout, either layer spec) into a TrainingEngine (a value model's from a
    value model's checkpoint, or with head="init" from a policy's, its head kept); returns
    the checkpoint's metadata. Collective for megatron checkpoints."""
    from gspo_megatron.checkpoint.loading import load_weights

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
