"""`gspo-train` with LoRA adapters (docs/LORA.md): the KL reference is the base model with the
adapters off, checkpoints hold the adapters with the frozen base, and a run killed mid-step and
resumed ends with the weights of a run never interrupted."""

from __future__ import annotations

import math

import pytest
import torch
from launch import checkpoint_tensors, read_metrics
from trainer.test_train_e2e import train

LORA = (
    "lora.rank=4",
    "algorithm.kl_coef=0.05",
    "trainer.steps=4",
    "trainer.save_every=2",
    "eval.every=0",
)


@pytest.mark.slow
def test_lora_run_with_kl_reference_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *LORA)
    # 4 optimizer steps per RL step: the 10th is in step 3, after the step-2 checkpoint
    train(resumed, *LORA, check=False, faults="kill_after_optimizer_step=10")
    proc = train(resumed, *LORA)
    assert "resumed at step 2" in proc.stderr
    records = read_metrics(straight)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # The reference is the initial policy: the first minibatch of step 1 has KL 0 exactly, and
    # the adapters move the policy away from it after that.
    assert all(math.isfinite(r["actor/kl_ref"]) for r in records)
    assert records[-1]["actor/kl_ref"] > 0
    # The rollouts are sampled with the adapters: their log-probs are the trainer's.
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-4 for r in records)
    assert [r["actor/loss"] for r in read_metrics(resumed)] == [r["actor/loss"] for r in records]
    at_2 = checkpoint_tensors(straight / "checkpoints" / "step_000002")
    at_4 = checkpoint_tensors(straight / "checkpoints" / "step_000004")
    adapters = [k for k in at_4 if k.endswith((".lora_a", ".lora_b"))]
    # one stacked entry per adapted layer kind (layers and experts are axes of each)
    assert sorted(k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1] for k in adapters) == [
        f"{layer}.{factor}"
        for layer in ("linear_fc1", "linear_fc2", "linear_proj", "linear_qkv")
        for factor in ("lora_a", "lora_b")
    ]
    for key, value in at_4.items():
        if key in adapters:
            assert not torch.equal(value, at_2[key]), key  # trained
        else:
            assert torch.equal(value, at_2[key]), key  # frozen
    final = checkpoint_tensors(resumed / "checkpoints" / "step_000004")
    assert final.keys() == at_4.keys()
    assert all(torch.equal(final[k], at_4[k]) for k in at_4)


@pytest.mark.slow
def test_ppo_with_a_lora_policy_trains_a_full_parameter_critic(tmp_path):
    """algorithm.advantage=gae with LoRA: the critic starts from the policy's base weights and
    trains every weight (no adapters); the policy trains its adapters only."""
    run = tmp_path / "ppo"
    train(run, "algorithm=ppo", "lora.rank=4", "trainer.steps=2", "trainer.save_every=1",
          "eval.every=0")  # fmt: skip
    assert all(math.isfinite(r["critic/value_loss"]) for r in read_metrics(run))
    steps = [run / "checkpoints" / f"step_00000{i}" for i in (1, 2)]
    policy = [checkpoint_tensors(s) for s in steps]
    critic = [checkpoint_tensors(s / "critic") for s in steps]
    assert not [k for k in critic[1] if k.endswith((".lora_a", ".lora_b"))]
    moved = [k for k in critic[1] if not torch.equal(critic[1][k], critic[0][k])]
    assert "decoder.layers.self_attention.linear_qkv.weight" in moved, moved
    for key, value in policy[1].items():
        adapter = key.endswith((".lora_a", ".lora_b"))
        assert torch.equal(value, policy[0][key]) != adapter, key
