"""Per-turn credit (algorithm.credit=turn) wired through the step's inputs: an episode's turns
and turn rewards, each token's advantage checked by hand; the trainer's loop with token losses
(float64 loss references) and PPO's GAE; gspo-train on the real engine (GSPO-token); the
refused combinations, by key."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from trainer.fakes import SMALL, build_fake_run
from trainer.test_trainer_options import AGGREGATION, SEQUENCE_RATIO_LOSSES, check_losses

from gspo_megatron.collector import RolloutBatch
from gspo_megatron.config import ConfigError
from gspo_megatron.data.dataset import Prompt
from gspo_megatron.rollout.base import EpisodeRecord, RolloutSample
from gspo_megatron.step_inputs import StepInputs, StepInputSettings

pytestmark = pytest.mark.usefixtures("one_thread")

ENV = ("env.name=envs.scripted_envs:TwoObservations", "env.max_turns=4", "env.max_tokens=24")


def settings(**changes) -> StepInputSettings:
    base = dict(
        advantage="group_mean_std", advantage_eps=1e-6, overlong_filter=False,
        partial_rollout_mask=False, old_logprobs="rollout", routing_replay="off",
        moe_route_metrics=False, mismatch="none", mismatch_level="token", mismatch_cap=2.0,
        mismatch_lower=0.5, mismatch_upper=2.0, gamma=1.0, lam=1.0, whiten_advantages=False,
        kl_reward_coef=0.0, kl_estimator="k3", mismatch_token_threshold=1.0, credit="turn",
        turn_gamma=0.5,
    )  # fmt: skip
    return StepInputSettings(**(base | changes))


def episode(turns: list[int], step_rewards: list[float], failure=None) -> RolloutSample:
    """Model turns of the given lengths with a 2-token observation between them."""
    response, mask, record = [], [], EpisodeRecord(turns=len(turns), failure=failure)
    for k, n in enumerate(turns):
        record.answer_start = len(response)
        if k < len(step_rewards) and failure is None:
            record.turn_rewards.append((len(response), step_rewards[k]))
        response += [5] * n
        mask += [1] * n
        if k < len(turns) - 1:
            response += [9, 9]
            mask += [0, 0]
    return RolloutSample([1, 2], response, [-0.1] * len(response), "stop", loss_mask=mask,
                         episode=record)  # fmt: skip


def test_token_advantages_by_hand():
    group = [
        episode([2, 3], [0.5, 0.0]),  # step rewards 0.5 then (final) 0
        episode([1, 1, 2], [0.0, 1.0]),  # the last turn was not stepped (cut): no reward
        episode([3], []),  # one turn
        episode([2, 2], [1.0], failure="error"),  # the failure replaced its record
    ]
    totals = [1.5, 2.0, 1.0, 0.0]  # the episodes' rewards (final scores included)
    batch = RolloutBatch(prompts=[Prompt(0, [1, 2], "p", "l")], groups=[group])
    batch.rewards = torch.tensor([totals])
    inputs = StepInputs(settings(), SimpleNamespace(model_config=SimpleNamespace(is_moe=False)))
    inputs.add_advantages(batch)
    inputs.add_samples(batch)

    # turn rewards: the step rewards but the last turn's, which takes the rest of the total
    turn_rewards = [[0.5, 1.0], [0.0, 1.0, 1.0], [1.0], [0.0, 0.0]]
    g = 0.5
    returns = [[r[k] + sum(g ** (j - k) * r[j] for j in range(k + 1, len(r))) for k in
                range(len(r))] for r in turn_rewards]  # fmt: skip

    def normalized(values):
        mean = sum(values) / len(values)
        if len(values) == 1:
            return [0.0]
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return [(v - mean) / (std + 1e-6) for v in values]

    at = {}
    for k in range(3):
        owners = [b for b, r in enumerate(returns) if k < len(r)]
        for b, a in zip(owners, normalized([returns[b][k] for b in owners]), strict=True):
            at[b, k] = a
    for b, (sample, x) in enumerate(zip(group, batch.samples, strict=True)):
        turn, expected = -1, []
        for i, m in enumerate(sample.loss_mask):
            if m and (i == 0 or not sample.loss_mask[i - 1]):
                turn += 1
            expected.append(at[b, turn] if m else 0.0)
        assert x.advantage == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert batch.advantages[0].tolist() == pytest.approx([at[b, 0] for b in range(4)], rel=1e-6)


def test_gae_returns_are_the_turn_rewards_to_go():
    """With GAE (gamma = lam = 1), a token's return is the sum of the rewards of the turns that
    end at or after it, whatever the critic's values: each turn's reward sits on its last
    token."""
    import numpy as np

    group = [episode([2, 3], [0.5, 0.0]), episode([1, 1, 2], [0.0, 1.0]), episode([3], [])]
    batch = RolloutBatch(prompts=[Prompt(0, [1, 2], "p", "l")], groups=[group])
    batch.rewards = torch.tensor([[1.5, 2.0, 1.0]])
    critic = SimpleNamespace(
        forward=lambda samples: SimpleNamespace(
            values=[np.linspace(-1, 1, len(x.response_ids)) for x in samples]
        )
    )
    policy = SimpleNamespace(model_config=SimpleNamespace(is_moe=False))
    inputs = StepInputs(settings(advantage="gae", turn_gamma=1.0), policy, critic=critic)
    inputs.add_advantages(batch)
    inputs.add_samples(batch)
    turn_rewards = [[0.5, 1.0], [0.0, 1.0, 1.0], [1.0]]
    for sample, x, rewards in zip(group, batch.samples, turn_rewards, strict=True):
        turn, expected = -1, []
        for i, m in enumerate(sample.loss_mask):
            if m and (i == 0 or not sample.loss_mask[i - 1]):
                turn += 1
            expected.append(sum(rewards[turn:]) if m else 0.0)
        assert x.returns == pytest.approx(expected, abs=1e-9)


def test_undiscounted_turn_credit_of_single_turn_responses_is_the_episode_advantage():
    group = [episode([3], []), episode([2], [0.5]), episode([4], [])]
    batch = RolloutBatch(prompts=[Prompt(0, [1, 2], "p", "l")], groups=[group])
    batch.rewards = torch.tensor([[1.0, 0.5, 0.0]])
    policy = SimpleNamespace(model_config=SimpleNamespace(is_moe=False))
    turn = StepInputs(settings(turn_gamma=1.0), policy)
    turn.add_advantages(batch)
    turn.add_samples(batch)
    by_turn = [x.advantage for x in batch.samples]
    StepInputs(settings(credit="episode"), policy).add_advantages(batch)
    for adv, episode_adv in zip(by_turn, batch.advantages[0].tolist(), strict=True):
        assert adv == pytest.approx([episode_adv] * len(adv), rel=1e-6)


def run(composer, tokenizer, *overrides):
    cfg, model, layout = composer.resolve(*SMALL, *ENV, "algorithm.credit=turn", *overrides)
    fake = build_fake_run(cfg, model, layout, tokenizer)
    fake.train()
    return fake


@pytest.mark.parametrize("loss", sorted(set(AGGREGATION) - SEQUENCE_RATIO_LOSSES - {"ppo"}))
def test_token_losses_train_on_turn_advantages(composer, tokenizer, loss):
    fake = run(composer, tokenizer, f"algorithm={loss}", "algorithm.turn_gamma=0.9")
    check_losses(fake, [e for step in fake.journal.steps() for e in step])
    trained = [s for c in fake.journal.calls("train") for s in c.samples]
    assert all(isinstance(s.advantage, list) for s in trained)
    varied = 0
    for s in trained:
        turns, turn = [], -1
        for i, m in enumerate(s.loss_mask):
            if m and (i == 0 or not s.loss_mask[i - 1]):
                turn += 1
                turns.append(set())
            if m:
                turns[turn].add(s.advantage[i])
        assert all(len(values) == 1 for values in turns)  # one advantage per turn
        varied += len({v for values in turns for v in values}) > 1
    assert varied, "no episode had turns with different advantages"


def test_gae_with_turn_rewards(composer, tokenizer):
    fake = run(composer, tokenizer, "algorithm=ppo", "critic.warmup_steps=0")
    trained = [s for c in fake.journal.calls("train") for s in c.samples]
    assert trained and all(isinstance(s.advantage, list) for s in trained)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("algorithm.credit=turn",), "algorithm.credit=turn needs multi-turn episodes"),
        ((*ENV, "algorithm.credit=turn"), "algorithm.loss=gspo multiplies its sequence-level"),
        ((*ENV, "algorithm=gmpo", "algorithm.credit=turn"), "algorithm.loss=gmpo"),
        ((*ENV, "algorithm.turn_gamma=0.9"), "algorithm.turn_gamma=0.9 is set but only"),
        ((*ENV, "algorithm=ppo", "algorithm.credit=turn", "algorithm.turn_gamma=0.9"),
         "algorithm.turn_gamma=0.9 with algorithm.advantage=gae"),
        ((*ENV, "algorithm=grpo", "algorithm.credit=token"), "algorithm.credit"),
        ((*ENV, "algorithm=grpo", "algorithm.credit=turn", "algorithm.turn_gamma=1.5"),
         "algorithm.turn_gamma"),
    ],
)  # fmt: skip
def test_refused(composer, overrides, message):
    with pytest.raises(ConfigError, match=message):
        composer.resolve(*SMALL, *overrides)


def test_turn_credit_through_gspo_train(tmp_path):
    """The real engine: its forwards take one advantage per sequence, its loss the tokens'."""
    from trainer.test_train_e2e import MULTI_TURN, metrics, train

    train(
        tmp_path, *MULTI_TURN, "algorithm=gspo_token", "algorithm.credit=turn",
        "algorithm.turn_gamma=0.5", "trainer.steps=2", "eval.every=0",
    )  # fmt: skip
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/optimizer_steps"] >= 1 and r["env/turns_mean"] > 1 for r in records)
