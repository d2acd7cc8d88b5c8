"""Multi-turn episodes through the trainer's real loop on fake engines: every loss sees only the
model's tokens (float64 references with the episodes' masks), an episode's reward is the reward
section's score of its final answer plus the environment's step rewards (0 when the environment
failed), and the env/ metrics count turns, tool calls and failures."""

from __future__ import annotations

import pytest
from trainer.fakes import SMALL, build_fake_run
from trainer.test_trainer_options import AGGREGATION, check_losses

from gspo_megatron.collector import RolloutBatch
from gspo_megatron.rewards.synthetic import partial_credit
from gspo_megatron.rollout.base import EpisodeRecord, RolloutSample

pytestmark = pytest.mark.usefixtures("one_thread")


ENV = ("env.name=envs.scripted_envs:TwoObservations", "env.max_turns=4", "env.max_tokens=24")


def run(composer, tokenizer, *overrides):
    cfg, model, layout = composer.resolve(*SMALL, *ENV, *overrides)
    fake = build_fake_run(cfg, model, layout, tokenizer)
    fake.train()
    return fake


@pytest.mark.parametrize("loss", sorted(AGGREGATION))
def test_losses_over_model_tokens_only(composer, tokenizer, loss):
    fake = run(composer, tokenizer, f"algorithm={loss}", "algorithm.kl_coef=0.1")
    steps = fake.journal.steps()
    check_losses(fake, [e for step in steps for e in step])
    trained = [s for c in fake.journal.calls("train") for s in c.samples]
    masked = [s for s in trained if s.loss_mask is not None and 0 in s.loss_mask]
    assert masked, "no trained episode had an observation"
    records = fake.log.records
    assert all(dict(m)["env/turns_mean"] > 1 for _, m in records)
    assert all(dict(m)["env/model_token_fraction"] < 1 for _, m in records)


def test_episode_reward_is_answer_score_plus_step_rewards(composer, tokenizer):
    fake = run(composer, tokenizer)
    collector = fake.trainer.collector
    prompt = fake.train_data.prompts[0]
    answer = tokenizer.encode(prompt.label, add_special_tokens=False)
    observation = tokenizer.encode("+:+", add_special_tokens=False)
    eos = tokenizer.eos_token_id

    def episode(record: EpisodeRecord) -> RolloutSample:
        response = [5, 6, eos] + observation + answer + [eos]
        record.answer_start = 3 + len(observation)
        mask = [1, 1, 1] + [0] * len(observation) + [1] * (len(answer) + 1)
        return RolloutSample(
            list(prompt.prompt_ids), response, [-0.5] * len(response), "stop",
            loss_mask=mask, episode=record,
        )  # fmt: skip

    group = [
        episode(EpisodeRecord(turns=2, env_reward=0.25)),
        episode(EpisodeRecord(turns=2, env_reward=0.25, failure="error")),
        episode(EpisodeRecord(turns=2, env_reward=0.25, failure="timeout")),
        episode(EpisodeRecord(turns=2, env_reward=0.0, failure="tool_error")),
    ]
    batch = RolloutBatch(prompts=[prompt], groups=[group])
    rewards = collector.score(batch)
    assert collector.response_text(group[0]) == prompt.label
    assert partial_credit(prompt.label, prompt.label) == 1.0
    assert rewards.tolist() == [[1.25, 0.0, 0.0, 0.0]]
    assert batch.failed_rewards == 2


def test_env_metrics_and_failures_counted(composer, tokenizer):
    fake = run(composer, tokenizer, "trainer.steps=3")
    for _, metrics in fake.log.records:
        m = dict(metrics)
        assert m["env/tool_call_rate"] > 0 and m["env/tool_calls_per_episode"] > 0
        assert m["env/timeouts"] == 0
        assert m["reward/failed_fraction"] == m["env/failures"] / 16
    assert any(dict(m)["env/failures"] > 0 for _, m in fake.log.records)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mismatch_weights_over_model_tokens(composer, tokenizer, level):
    """Observations have no rollout log-prob (0 placeholders): the TIS weights and the
    mismatch metrics come from the model's tokens only."""
    import math

    fake = run(
        composer, tokenizer, "algorithm=grpo", "algorithm.mismatch=tis",
        f"algorithm.mismatch_level={level}", "algorithm.mismatch_cap=1000",
    )  # fmt: skip
    checked = 0
    for call in fake.journal.calls("train"):
        for s in call.samples:
            model = [m != 0 for m in s.loss_mask] if s.loss_mask is not None else None
            if model is None or all(model):
                continue
            log_w = [o - r for o, r, m in zip(s.old_logprobs, s.rollout_logprobs, model,
                                             strict=True) if m]  # fmt: skip
            if level == "token":
                got = [w for w, m in zip(s.is_weights, model, strict=True) if m]
                assert got == pytest.approx([math.exp(x) for x in log_w], rel=1e-9)
            else:
                total = sum(log_w) / (len(log_w) if level == "geometric" else 1)
                assert s.is_weights == pytest.approx(math.exp(total), rel=1e-9)
            checked += 1
    assert checked
