#!/bin/bash
# Qwen3-30B-A3B, GSPO on math prompts, 2 nodes x 8 GPUs of 80 GB, colocated (embedded rollout).
# Layout parallel=qwen3_30b_a3b_16gpu: tp 2 (+SP) x pp 2, experts ep 8 (dp 4, edp 1); full
# recomputation; micro-batches of 18432 tokens (responses up to 8192 after 1024 prompt tokens).
# tools/plan_memory.py: worst rank (stage 1) 45.1 of 79.6 GiB.
#
#   HF_DIR=/ckpt/Qwen3-30B-A3B-Base DATA=/data/math_train.jsonl \
#     bash slurm/examples/qwen3_30b_a3b_2nodes.sh [more overrides] [sbatch via SBATCH_* env]
#   bash slurm/examples/qwen3_30b_a3b_2nodes.sh --dry-run   # the checks only; no Slurm needed
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=2 gpus=8 gpu_gib=79.6
overrides=(
  model=qwen3_30b_a3b "model.init_from=${HF_DIR:-/ckpt/Qwen3-30B-A3B-Base}"
  parallel=qwen3_30b_a3b_16gpu
  data=jsonl "data.train_files=[${DATA:-/data/math_train.jsonl}]" reward=math
  algorithm=gspo rollout.prompts_per_step=64 rollout.group_size=8 rollout.max_new_tokens=8192
  engine.max_sequence_length=9216 engine.max_tokens_per_microbatch=18432
  engine.recompute_activations=true optimizer.lr=1e-6 trainer.steps=500 trainer.save_every=10
)
if [[ "${1:-}" == --dry-run ]]; then
  exec "${GSPO_PYTHON:-python}" -m gspo_megatron.slurm preflight --dry-run --nodes "$nodes" \
    --gpus-per-node "$gpus" --gpu-memory-gib "$gpu_gib" "${overrides[@]}" "${@:2}"
fi
exec sbatch --nodes="$nodes" --gpus-per-node="$gpus" slurm/train.sbatch "${overrides[@]}" "$@"
