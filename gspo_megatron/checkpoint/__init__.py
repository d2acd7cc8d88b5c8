"""Hugging Face <-> megatron-core checkpoints for Qwen3-MoE and dense Qwen3, without megatron.

- `mapping`: the one name/layout mapping (megatron sharded keys <-> HF names), shared with the
  trainer side's weight export and loading (`gspo_megatron.megatron.weight_export`,
  `gspo_megatron.megatron.weight_loading`);
- `convert`: `convert_hf_to_megatron`, `convert_megatron_to_hf` (streamed, staged output; a
  verification function is passed in: `gspo_megatron.megatron.verify.conversion_difference`);
- `reading`: what an HF directory or a megatron checkpoint holds (architecture, head);
- `torch_dist`, `hf_io`: the two file formats, read and written tensor by tensor;
- `meta`, `manifest`, `safe_load`: checkpoint metadata, checksums, loading that runs no code.

Nothing here imports megatron-core (the layering contract in pyproject.toml checks it);
loading into model chunks, the log-prob verification and `gspo-logprobs` live on the megatron
side. See docs/CHECKPOINTS.md.
"""
