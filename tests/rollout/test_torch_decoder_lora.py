"""The embedded engine's lean torch decoder serving a LoRA policy
(tests/rollout/torch_decoder_lora_worker.py), on the tiny MoE (attention and every expert's
fc1/fc2 adapted) and the tiny dense model (attention and the MLP), rank 8, with whole weights
trained beside the adapters (lora.modules_to_save):

- with the adapters far from zero (B too), the decoder's log-probs equal megatron's forward
  with the adapter layers within 1e-5 (float32), and the same decoder with the adapters off
  is far from it (so an adapter left unmerged fails the first check);
- the engine picks the torch decoder for the policy (`rollout.backend=auto`), and its sampled
  log-probs equal the trainer's recompute within 1e-5, before and after three Adam steps on
  its own samples (the adapters moved; the merge reads them at each batch);
- `merged_weight` of a tensor-parallel shard is the shard of the whole merge (float64), for a
  column-parallel layer (weight and B split along the output) and a row-parallel one (weight
  and A split along the input).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run_worker

from gspo_megatron.checkpoint.lora_mapping import merged_weight

WORKER = Path(__file__).resolve().parent / "torch_decoder_lora_worker.py"

CHECKS = [
    "fresh_torch_vs_megatron",
    "torch_vs_megatron",
    "adapters_change_logprobs",
    "auto_picks_torch",
    "sampled_logprob_vs_trainer",
    "trained_adapters_moved",
    "trained_sampled_logprob_vs_trainer",
    "trained_torch_vs_megatron",
    "trained_adapters_change_logprobs",
]


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense"])
def test_torch_decoder_serves_a_lora_policy(model):
    results = {r["check"]: r for r in run_worker(WORKER, ["--model", model])}
    missing = [c for c in CHECKS if f"{model}_{c}" not in results]
    assert not missing, f"checks that did not run: {missing}"
    failed = [r for r in results.values() if not r["ok"]]
    assert not failed, failed


def test_merged_weight_of_a_shard_is_the_shard_of_the_merge():
    gen = torch.Generator().manual_seed(0)
    weight, a, b = (torch.randn(*shape, generator=gen, dtype=torch.float64)
                    for shape in ((12, 10), (4, 10), (12, 4)))  # fmt: skip
    whole = merged_weight(weight, a, b, 0.5)
    assert torch.equal(whole, weight + 0.5 * b @ a)
    column = [
        merged_weight(w, a, b_part, 0.5)
        for w, b_part in zip(weight.chunk(2), b.chunk(2), strict=True)
    ]
    torch.testing.assert_close(torch.cat(column), whole, rtol=0, atol=1e-12)
    row = [
        merged_weight(w, a_part, b, 0.5)
        for w, a_part in zip(weight.chunk(2, 1), a.chunk(2, 1), strict=True)
    ]
    torch.testing.assert_close(torch.cat(row, 1), whole, rtol=0, atol=1e-12)
