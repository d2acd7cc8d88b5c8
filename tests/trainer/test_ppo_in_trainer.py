"""PPO with a critic in the trainer's loop, on fake engines: what the critic is given and
trains on, the per-token KL penalty in the reward, critic warm-up, checkpoints, offload and the
configurations that are refused. GAE's advantages themselves are checked for every mismatch
mode in test_trainer_options.py (`check_gae_advantages`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from trainer.fakes import SMALL, MemoryCheckpoints, build_fake_run
from trainer.test_trainer_options import (
    _key,
    _step_calls,
    check_gae_advantages,
    expected_gae,
    generated_rewards,
)

from gspo_megatron.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

PPO = ("algorithm=ppo", *SMALL)


def run_ppo(composer, tokenizer, *overrides, checkpoints=None):
    cfg, model, layout = composer.resolve(*PPO, *overrides)
    run = build_fake_run(cfg, model, layout, tokenizer, checkpoints=checkpoints)
    run.train()
    return run


def reference_value_loss(call, table_before, clip) -> float:
    """Mean over the minibatch's trained tokens of 0.5 max((V - R)^2, (V_clip - R)^2)."""
    total = count = 0.0
    for s in call.samples:
        ids = s.prompt_ids + s.response_ids
        mask = s.loss_mask or [1.0] * len(s.response_ids)
        for t in range(len(s.response_ids)):
            if not mask[t]:
                continue
            v = float(table_before[ids[len(s.prompt_ids) - 1 + t]])
            old, ret = s.old_values[t], s.returns[t]
            loss = (v - ret) ** 2
            if clip:
                clipped = old + min(max(v - old, -clip), clip)
                loss = max(loss, (clipped - ret) ** 2)
            total += 0.5 * loss
            count += 1
    return total / count


def test_the_critic_values_the_batch_and_trains_on_every_policy_minibatch(composer, tokenizer):
    run = run_ppo(composer, tokenizer, "critic.value_clip=0.1")
    for events, (_, metrics) in zip(run.journal.steps(), run.log.records, strict=True):
        (critic_forward,) = _step_calls(events, "forward", "critic")
        value_trains = [c for k, c in events if k == "value_train"]
        policy_trains = _step_calls(events, "train")
        assert len(value_trains) == len(policy_trains) == run.cfg.algorithm.num_minibatches
        for value_call, policy_call in zip(value_trains, policy_trains, strict=True):
            assert [id(s) for s in value_call.samples] == [id(s) for s in policy_call.samples]
            assert value_call.clip == 0.1
            expected = reference_value_loss(value_call, value_call.params_before, 0.1)
            assert value_call.metrics["loss"] == pytest.approx(expected, rel=1e-12)
        assert {id(s) for s in critic_forward.samples} == {
            id(s) for c in policy_trains for s in c.samples
        }
        assert metrics["critic/loss"] == pytest.approx(
            np.mean([c.metrics["loss"] for c in value_trains])
        )
        assert metrics["critic/optimizer_steps"] == len(value_trains)
        for key in ("critic/explained_variance", "critic/explained_variance_in_update"):
            assert math.isfinite(metrics[key])
        check_gae_advantages(run, events)


def test_unclipped_value_loss_and_a_second_step_from_the_trained_critic(composer, tokenizer):
    run = run_ppo(composer, tokenizer, "critic.value_clip=0")
    calls = [c for k, c in run.journal.events if k == "value_train"]
    for call in calls:
        assert call.clip is None
        assert call.metrics["loss"] == pytest.approx(
            reference_value_loss(call, call.params_before, None), rel=1e-12
        )
    # the second step's values come from the critic the first step trained
    assert not np.array_equal(calls[0].params_before.numpy(), calls[-1].params_before.numpy())


def test_the_reward_carries_a_per_token_kl_penalty(composer, tokenizer):
    run = run_ppo(
        composer, tokenizer, "algorithm.kl_reward_coef=0.5", "algorithm.kl_estimator=k1",
        "algorithm.lam=0.95", "algorithm.whiten_advantages=true",
    )  # fmt: skip
    assert run.reference is not None
    alg = run.cfg.algorithm
    for events, (_, metrics) in zip(run.journal.steps(), run.log.records, strict=True):
        (forward,) = _step_calls(events, "forward", "critic")
        rewards = generated_rewards(run, events)
        samples = forward.samples
        penalties = []
        for s in samples:
            kl = [o - r for o, r in zip(s.old_logprobs, s.ref_logprobs, strict=True)]
            penalties.append(kl)
        # GAE with per-token rewards -beta*kl_t (+ the reward at the last token): by linearity,
        # the KL part is GAE of the penalties alone with zero values.
        values = [v.tolist() for v in forward.result.values]
        masks = [[1.0] * len(s.response_ids) for s in samples]
        final = [float(np.float32(rewards[_key(s)])) for s in samples]
        adv_reward, _ = expected_gae(final, values, masks, alg.gamma, alg.lam)
        adv_kl = []
        for kl in penalties:
            row, following = [0.0] * len(kl), 0.0
            for t in reversed(range(len(kl))):
                following = -0.5 * kl[t] + alg.gamma * alg.lam * following
                row[t] = following
            adv_kl.append(row)
        raw = [
            a + b
            for ra, rb in zip(adv_reward, adv_kl, strict=True)
            for a, b in zip(ra, rb, strict=True)
        ]
        mean = sum(raw) / len(raw)
        std = math.sqrt(sum((a - mean) ** 2 for a in raw) / (len(raw) - 1) + 1e-8)
        got = [a for s in samples for a in s.advantage]
        assert got == pytest.approx([(a - mean) / std for a in raw], rel=1e-8, abs=1e-8)
        flat_kl = [k for row in penalties for k in row]
        assert metrics["reward/kl_penalty_mean"] == pytest.approx(0.5 * np.mean(flat_kl))
    # the policy moves away from the reference, so the penalty is not identically 0
    assert any(metrics["reward/kl_penalty_mean"] != 0 for _, metrics in run.log.records)


def test_warmup_steps_train_the_critic_only(composer, tokenizer):
    run = run_ppo(composer, tokenizer, "critic.warmup_steps=1", "trainer.steps=3")
    steps = run.journal.steps()
    assert len(steps) == 3
    assert not _step_calls(steps[0], "train")
    assert [k for k, _ in steps[0]].count("value_train") == 2
    assert all(_step_calls(events, "train") for events in steps[1:])
    first = run.log.records[0][1]
    assert first["actor/optimizer_steps"] == 0 and first["critic/optimizer_steps"] == 2
    assert run.policy.steps_done == 4 and run.critic.steps_done == 6


def test_a_resumed_run_continues_with_the_saved_critic(composer, tokenizer):
    store = MemoryCheckpoints()
    first = run_ppo(composer, tokenizer, "trainer.save_every=1", checkpoints=store)
    saved = first.critic.state_dict()["table"]
    again = run_ppo(composer, tokenizer, "trainer.steps=3", checkpoints=store)
    (resumed_step,) = again.journal.steps()
    value_train = next(c for k, c in resumed_step if k == "value_train")
    assert np.array_equal(value_train.params_before.numpy(), saved.numpy())


def test_offload_moves_the_critic_out_while_rollouts_generate(composer, tokenizer):
    run = run_ppo(composer, tokenizer, "trainer.offload_during_rollout=optimizer")
    offloads = [c for k, c in run.journal.events if k == "offload" and c.engine == "critic"]
    assert len(offloads) == 2 and all(not c.keep_weights for c in offloads)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (("algorithm.loss=gspo",), "algorithm.loss=gspo takes one advantage per sequence"),
        (("algorithm.loss=gmpo",), "algorithm.loss=gmpo takes one advantage per sequence"),
        (("critic.warmup_steps=2",), "critic.warmup_steps=2 leaves no step"),
        (("critic.optimizer.min_lr=1",), "critic.optimizer.min_lr=1 must not exceed"),
        (("critic.parallel.tp=2",), r"world size 1 is not divisible by critic\.parallel\.tp"),
        (
            ("critic.parallel.sequence_parallel=true",),
            r"critic\.parallel\.sequence_parallel needs critic\.parallel\.tp > 1",
        ),
        (("critic.parallel.tp=0",), r"critic\.parallel\.tp must be a positive integer"),
    ],
)
def test_refused_ppo_configurations(composer, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        composer.resolve(*PPO, *overrides)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("critic.warmup_steps=1", "critic.warmup_steps"),
        ("critic.init_from=/tmp", "critic.init_from"),
        ("critic.value_clip=0.1", "critic.value_clip"),
        ("critic.optimizer.lr=0.01", "critic.optimizer"),
        ("algorithm.gamma=0.9", "algorithm.gamma"),
        ("algorithm.lam=0.5", "algorithm.lam"),
        ("algorithm.kl_reward_coef=0.1", "algorithm.kl_reward_coef"),
        ("critic.parallel.pp=1", "critic.parallel"),
    ],
)
def test_critic_settings_without_gae_are_refused(composer, override, key):
    with pytest.raises(ConfigError, match=f"{key} is set but only PPO"):
        composer.resolve("algorithm=grpo", *SMALL, override)


@pytest.mark.parametrize("key", ["reward.model_weight", "reward.rule_weight"])
def test_reward_weights_without_a_reward_model_are_refused(composer, key):
    with pytest.raises(ConfigError, match=f"{key} is set but there is no reward model"):
        composer.resolve(*PPO, f"{key}=0.5")


def test_reward_models_that_do_not_fit_are_refused_before_building(tmp_path):
    """gspo-train names reward.model_path and the reason, before any model is built: a policy
    checkpoint (no score head), and a reward model whose vocabulary misses the tokenizer's ids."""
    from launch import gspo_train, hf_policy

    policy = hf_policy(tmp_path / "policy")
    rm = hf_policy(tmp_path / "rm", reward_model=True, vocab_size=16)
    for path, reason in ((policy, "score.weight"), (rm, "the tokenizer")):
        proc = gspo_train(
            tmp_path / f"run_{path.name}", "algorithm=ppo", f"reward.model_path={path}",
            "trainer.steps=1", expect="failure",
        )  # fmt: skip
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("gspo-train: config error")]
        assert f"reward.model_path={path}: " in line and reason in line, line
    proc = gspo_train(
        tmp_path / "run_critic", "algorithm=ppo", f"critic.init_from={policy}",
        "trainer.steps=1", expect="failure",
    )  # fmt: skip
    assert f"critic.init_from={policy}: " in proc.stderr and "score.weight" in proc.stderr
    assert "A critic starts from the policy's weights when critic.init_from is null" in (
        proc.stderr
    )
