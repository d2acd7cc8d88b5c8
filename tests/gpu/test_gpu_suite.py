"""The one-GPU suite: bf16, NCCL at world size 1, each check in a worker process
(tests/gpu/gpu_worker.py says what each check compares and why the tolerances are what they
are). benchmarks/gpu_check.py runs the same checks without pytest."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_worker

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).resolve().parent / "gpu_worker.py"


def run_check(name: str, *args: str) -> list[dict]:
    results = run_worker(WORKER, ["--checks", name, *args])  # exit 1 when a check fails
    assert results, "the worker printed no check"
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
    return results


def test_train_step():
    results = run_check("train")
    assert {r["check"] for r in results} >= {"train/loss_finite", "train/weights_change"}


def test_embedded_generation_logprobs_match_recompute():
    results = run_check("generate")
    assert sum(r["check"].endswith("sampled_vs_recomputed_max") for r in results) == 2


def test_weight_export_lands_on_gpu_with_hf_names():
    results = run_check("export")
    assert "export/names_match_mapping" in {r["check"] for r in results}


def test_checkpoint_round_trip():
    results = run_check("checkpoint")
    assert "checkpoint/optimizer_state_identical" in {r["check"] for r in results}


def test_offload_frees_what_the_planner_says_and_trains_identically():
    results = run_check("offload")
    assert {r["check"] for r in results} >= {
        "offload/freed_vs_planner_rel",
        "offload/training_bitwise_identical",
    }


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory) -> Path:
    """fp32 weights and log-probs from a CPU process (CUDA hidden)."""
    out = tmp_path_factory.mktemp("gpu_cpu_reference")
    run_worker(WORKER, ["--cpu-reference", str(out)], env={"CUDA_VISIBLE_DEVICES": ""})
    return out


def test_bf16_logprobs_match_cpu_fp32(cpu_reference):
    results = run_check("logprobs", "--reference", str(cpu_reference))
    assert "logprobs/bf16_vs_cpu_fp32_max" in {r["check"] for r in results}
