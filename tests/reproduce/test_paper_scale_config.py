"""conf/experiment/gspo_qwen3_30b_a3b.yaml: composes, validates and fits, for GSPO and for the
paper's GRPO baseline, through the Slurm preflight's dry run (no GPU, no Slurm needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launch import REPO

PATHS = [
    "model.init_from=/ckpt/q30b",
    "model.tokenizer=/ckpt/q30b-hf",
    "data.train_files=[/data/math_train.jsonl]",
    "eval.benchmarks.aime24.files=[/data/aime24.jsonl]",
]


@pytest.mark.parametrize(
    "algorithm",
    [[], ["algorithm=grpo_paper_baseline", "algorithm.routing_replay=r2"]],
    ids=["gspo", "grpo_rr"],
)
def test_paper_scale_experiment_passes_preflight(algorithm):
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.slurm",
        "preflight",
        "--dry-run",
        "--nodes=2",
        "--gpus-per-node=8",
        "--gpu-memory-gib=79.6",  # fits an 80 GB H100 too, not only an H200
        "--sglang-servers=1",  # as slurm/train_disaggregated.sbatch: one SGLang node
        "+experiment=gspo_qwen3_30b_a3b",
        *PATHS,
        *algorithm,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "tp=2 pp=2 vpp=1 cp=1 dp=4 ep=8" in output
    assert "fits" in output and "preflight ok" in output


def test_paper_scale_lora_experiment_passes_preflight():
    """conf/experiment/gspo_qwen3_30b_a3b_lora.yaml: the paper-scale run with LoRA (rank 16,
    colocated embedded generation) composes, passes the config checks and fits an 80 GB GPU."""
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.slurm",
        "preflight",
        "--dry-run",
        "--nodes=2",
        "--gpus-per-node=8",
        "--gpu-memory-gib=79.6",
        "+experiment=gspo_qwen3_30b_a3b_lora",
        *PATHS,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "tp=2 pp=2 vpp=1 cp=1 dp=4 ep=8" in output
    assert "fits" in output and "preflight ok" in output
