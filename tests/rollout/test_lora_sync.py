"""A LoRA policy's weight sync gathered from TP2 + SP (tests/rollout/lora_sync_worker.py):
transformers loading the merged weights (rollout.sglang.lora_sync=merged), and PEFT loading the
base weights with the PEFT-named adapters, both give the engine's log-probs with its adapters
within 1e-5 (float32); the base model alone is far from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_worker

WORKER = Path(__file__).resolve().parent / "lora_sync_worker.py"
CHECKS = ["merged_transformers_vs_engine", "peft_adapters_vs_engine", "adapters_change_logprobs"]


@pytest.mark.distributed
def test_lora_weight_sources_against_transformers_and_peft():
    results = {r["check"]: r for r in run_worker(WORKER, ["tp=2,sp=1"], nproc=2) if "check" in r}
    assert sorted(results) == sorted(CHECKS), sorted(results)
    failed = [r for r in results.values() if not r["ok"]]
    assert not failed, failed
