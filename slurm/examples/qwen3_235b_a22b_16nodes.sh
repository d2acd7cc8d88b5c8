#!/bin/bash
# Qwen3-235B-A22B, GSPO on math prompts, 16 nodes x 8 GPUs of 80 GB, colocated.
# Layout: tp 4 (+SP) x pp 2 (94 layers allow pp 1 or 2), experts ep 64 (dp 16, edp 1); full
# recomputation; micro-batches of 18432 tokens.
# tools/plan_memory.py: worst rank (stage 1) 45.6 of 79.6 GiB. On 8 such nodes (ep 32) the
# plan is 76.0 GiB: too close to the limit; use 8 nodes only with larger GPUs (the H200 example).
#
#   HF_DIR=/ckpt/Qwen3-235B-A22B DATA=/data/math_train.jsonl \
#     bash slurm/examples/qwen3_235b_a22b_16nodes.sh [more overrides]
#   bash slurm/examples/qwen3_235b_a22b_16nodes.sh --dry-run   # checks only
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=16 gpus=8 gpu_gib=79.6
overrides=(
  model=qwen3_235b_a22b "model.init_from=${HF_DIR:-/ckpt/Qwen3-235B-A22B}"
  parallel.tp=4 parallel.pp=2 parallel.ep=64 parallel.sequence_parallel=true
  data=jsonl "data.train_files=[${DATA:-/data/math_train.jsonl}]" reward=math
  algorithm=gspo rollout.prompts_per_step=128 rollout.group_size=8 rollout.max_new_tokens=8192
  engine.max_sequence_length=9216 engine.max_tokens_per_microbatch=18432
  engine.recompute_activations=true optimizer.lr=1e-6 trainer.steps=300 trainer.save_every=5
)
if [[ "${1:-}" == --dry-run ]]; then
  exec "${GSPO_PYTHON:-python}" -m gspo_megatron.slurm preflight --dry-run --nodes "$nodes" \
    --gpus-per-node "$gpus" --gpu-memory-gib "$gpu_gib" "${overrides[@]}" "${@:2}"
fi
# Big model: ask for the pre-time-limit SIGTERM early enough for one RL step and a checkpoint.
exec sbatch --nodes="$nodes" --gpus-per-node="$gpus" --signal=B:TERM@1200 slurm/train.sbatch \
  "${overrides[@]}" "$@"
