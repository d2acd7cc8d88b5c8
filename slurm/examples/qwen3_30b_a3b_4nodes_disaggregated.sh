#!/bin/bash
# Qwen3-30B-A3B, GSPO on math prompts, 4 nodes x 8 GPUs of 80 GB: 2 nodes train (tp 2 (+SP) x
# pp 2, experts ep 8), 2 nodes run one SGLang server each (tp 8, ep 8); weights by NCCL
# broadcast after every step. tools/plan_memory.py (trainer): worst rank 45.1 of 79.6 GiB.
#
#   HF_DIR=/ckpt/Qwen3-30B-A3B-Base DATA=/data/math_train.jsonl \
#     bash slurm/examples/qwen3_30b_a3b_4nodes_disaggregated.sh [more overrides]
#   bash slurm/examples/qwen3_30b_a3b_4nodes_disaggregated.sh --dry-run   # checks only
#
# Asynchronous (docs/ROLLOUT.md, "Asynchronous rollouts"): the servers generate the next two
# batches while the trainer trains; each weight update aborts the requests running and
# continues them on the new weights (partial rollouts), no trained token more than two
# versions old:
#   bash slurm/examples/qwen3_30b_a3b_4nodes_disaggregated.sh rollout.mode=async \
#     rollout.queue_batches=2 rollout.max_staleness=2
set -euo pipefail
cd "$(dirname "$0")/../.."
train_nodes=2 rollout_nodes=2 gpus=8 gpu_gib=79.6
export HF_DIR=${HF_DIR:-/ckpt/Qwen3-30B-A3B-Base}
overrides=(
  model=qwen3_30b_a3b "model.init_from=$HF_DIR"
  parallel=qwen3_30b_a3b_16gpu
  data=jsonl "data.train_files=[${DATA:-/data/math_train.jsonl}]" reward=math
  algorithm=gspo rollout.prompts_per_step=64 rollout.group_size=8 rollout.max_new_tokens=8192
  engine.max_sequence_length=9216 engine.max_tokens_per_microbatch=18432
  engine.recompute_activations=true optimizer.lr=1e-6 trainer.steps=500 trainer.save_every=10
)
if [[ "${1:-}" == --dry-run ]]; then
  exec "${GSPO_PYTHON:-python}" -m gspo_megatron.slurm preflight --dry-run \
    --nodes "$train_nodes" --gpus-per-node "$gpus" --gpu-memory-gib "$gpu_gib" \
    --sglang-servers "$rollout_nodes" "${overrides[@]}" "${@:2}"
fi
exec sbatch --nodes="$train_nodes" : --nodes="$rollout_nodes" slurm/train_disaggregated.sbatch \
  "${overrides[@]}" "$@"
