"""Weight export: TP2xEP2 shards gathered bucket by bucket into HF names equal the one-process
model's export bitwise, and transformers' Qwen3MoeForCausalLM loads them with the megatron
engine's log-probs (<= 1e-5, fp32).

The one-process reference is megatron's own (random weights, dist_checkpointing save), so the
gathering is checked against an independent writer of the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_worker

WORKER = Path(__file__).resolve().parents[1] / "checkpoint" / "export_worker.py"


@pytest.mark.distributed
def test_export_from_tp2_ep2_equals_single_process_and_loads_in_transformers(tmp_path):
    run_worker(WORKER, ["--make-reference", str(tmp_path)], nproc=1)
    results = run_worker(
        WORKER,
        [
            "--ref-dir",
            str(tmp_path),
            "--layout",
            "tp=2,sp=1,ep=2",
            "--hf-out",
            str(tmp_path / "hf"),
        ],
        nproc=4,
    )
    checks = {r["check"]: r for r in results}
    for name in (
        "non_senders_hold_nothing",
        "same_names_same_order",
        "tensors_bitwise_equal_to_single_process",
        "oversized_buckets",
        "several_buckets",
        "per_expert_names",
        "transformers_class_is_qwen3_moe",
        "transformers_logprobs_vs_megatron",
    ):
        assert name in checks, results
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
