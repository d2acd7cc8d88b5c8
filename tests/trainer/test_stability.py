"""Guardrails, telemetry, the mismatch budget and the collapse sentinel through `Trainer.train()`
on fake engines (tests/trainer/fakes.py): what the config refuses, what each step reports, when
the sentinel fires, where it rolls back to, what the remedy changes, and that a rollback
interrupted at any point and resumed ends exactly where the uninterrupted one does."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from trainer.fakes import MemoryCheckpoints, MemoryLog, build_fake_run

from gspo_megatron import CONF_DIR
from gspo_megatron.config import ConfigError
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.stability import StabilityError

pytestmark = pytest.mark.usefixtures("one_thread")

# 10 steps, a checkpoint every 2; the sentinel reacts within a step or two (the defaults wait
# for 20 steps of history and 3-5 steps of a signal: docs/STABILITY.md). The fake policy's
# synthetic reward is small and noisy (~0.09): the reward signal is watched on a reward of its
# own (REWARD_WATCHED).
WATCHED = (
    "trainer.steps=10",
    "trainer.save_every=2",
    "trainer.keep_last=10",
    "stability.sentinel.nonfinite_patience=1",
    "stability.sentinel.warmup_steps=2",
    "stability.sentinel.window=2",
    "stability.sentinel.reward_drop=0",
    "stability.sentinel.lr_steps=3",
)
# 1 for a response that starts with a digit: about half of the fake policy's
REWARD_WATCHED = (
    *WATCHED,
    "reward.name=trainer.fakes:StartsWithDigit",
    "stability.sentinel.reward_drop=0.3",
    "stability.sentinel.reward_patience=2",
)
VOLATILE = ("time/", "perf/")


def fake_run(composer, tokenizer, *overrides, **kwargs):
    cfg, model, layout = composer.resolve(*overrides)
    return build_fake_run(cfg, model, layout, tokenizer, **kwargs)


def stable(records):
    return [(s, {k: v for k, v in m.items() if not k.startswith(VOLATILE)}) for s, m in records]


def skip_train_call(run, number: int) -> None:
    """The policy's `number`-th train_step (counted in this process) is skipped for a
    non-finite loss, as engine.nonfinite=skip does: a corrupted batch."""
    original, calls = run.policy.train_step, [0]

    def train_step(samples, loss, **kwargs):
        calls[0] += 1
        if calls[0] != number:
            return original(samples, loss, **kwargs)
        return {"loss": float("nan"), "grad_norm": float("nan"), "skipped": 1.0,
                "lr": run.policy.current_lr(), "num_microbatches": 1.0}  # fmt: skip

    run.policy.train_step = train_step


def destroy_policy_at_train_call(run, number: int, tokenizer) -> None:
    """After the policy's `number`-th train_step, it answers only "x": reward 0 in every group,
    so no advantage and no gradient brings it back (a collapse)."""
    original, calls = run.policy.train_step, [0]
    x = tokenizer.convert_tokens_to_ids("x")

    def train_step(samples, loss, **kwargs):
        calls[0] += 1
        out = original(samples, loss, **kwargs)
        if calls[0] == number:
            with torch.no_grad():
                run.policy.table[:, x] += 100.0
        return out

    run.policy.train_step = train_step


def steps_of(run):
    return [s for s, _ in run.log.records]


# -- guardrails ---------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml")))
def test_every_algorithm_preset_passes_the_clip_guardrail(composer, preset):
    composer.resolve(f"algorithm={preset}")


def test_gspo_with_a_ppo_clip_is_refused_unless_allowed(composer, tokenizer):
    clip = ("algorithm.hparams.clip_low=0.2", "algorithm.hparams.clip_high=0.2")
    with pytest.raises(ConfigError) as err:
        composer.resolve(*clip)
    message = str(err.value)
    assert message.startswith("algorithm.hparams.clip_low=0.2 is a token-scale clip, but gspo")
    assert "3e-4 / 4e-4 (arXiv 2507.18071)" in message
    assert "stability.allow_clip_scale_mismatch=true" in message
    run = fake_run(composer, tokenizer, *clip, "stability.allow_clip_scale_mismatch=true")
    run.train()
    assert steps_of(run) == [1, 2]
    with pytest.raises(ConfigError, match="algorithm.hparams.clip_high=0.0004 is a sequence"):
        composer.resolve("algorithm=grpo", "algorithm.hparams.clip_high=4e-4")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stability.mismatch_budget.k3_kl=0.01", "algorithm.old_logprobs=rollout"],
         "stability.mismatch_budget.k3_kl compares the rollout's log-probs with the trainer's "
         "old-policy forward, which algorithm.old_logprobs=rollout does not run"),
        (["model=tiny_dense", "stability.mismatch_budget.route_flips=0.1"],
         "stability.mismatch_budget.route_flips needs a Mixture-of-Experts model"),
        (["stability.mismatch_budget.route_flips=0.1", "algorithm.routing_replay=r3"],
         "stability.mismatch_budget.route_flips with algorithm.routing_replay=r3"),
        (["stability.mismatch_budget.route_flips=0.1", "logging.moe_route_metrics=false"],
         "stability.mismatch_budget.route_flips needs the rollout engine's routes: set "
         "logging.moe_route_metrics=true"),
        (["stability.mismatch_budget.remedy=mis"],
         "stability.mismatch_budget.remedy=mis has no budget to act on"),
        (["stability.mismatch_budget.k3_kl=0.01", "stability.mismatch_budget.remedy=mis",
          "algorithm.old_logprobs=rollout"],
         "stability.mismatch_budget.k3_kl compares"),
        (["stability.mismatch_budget.route_flips=0.1", "stability.mismatch_budget.remedy=mis",
          "algorithm.old_logprobs=rollout", "algorithm.routing_replay=r2"],
         "stability.mismatch_budget.remedy=mis needs the trainer's own old log-probs"),
        (["stability.mismatch_budget.k3_kl=0.01", "stability.mismatch_budget.remedy=mis",
          "algorithm.mismatch=tis", "algorithm.mismatch_level=sequence"],
         "stability.mismatch_budget.remedy=mis with algorithm.mismatch=tis"),
        (["stability.mismatch_budget.k3_kl=0.01", "stability.mismatch_budget.remedy=mis"],
         "stability.mismatch_budget.remedy=mis would turn on algorithm.mismatch=mis at "
         "algorithm.mismatch_level=token with algorithm.loss=gspo"),
        (["stability.mismatch_budget.k3_kl=0.01",
          "stability.mismatch_budget.remedy=lower_staleness"],
         "stability.mismatch_budget.remedy=lower_staleness with rollout.mode=sync"),
        (["stability.mismatch_budget.k3_kl=0.01", "rollout.mode=one_step_off",
          "stability.mismatch_budget.remedy=lower_staleness"],
         "stability.mismatch_budget.remedy=lower_staleness with rollout.max_staleness=1"),
        (["stability.sentinel.on_mismatch_budget=true"],
         "stability.sentinel.on_mismatch_budget needs a budget"),
        (["engine.entropy_metric=false"],
         "stability.sentinel.entropy_fraction watches actor/entropy, which "
         "engine.entropy_metric=false turns off"),
        (["stability.sentinel.remedy=skip_window", "stability.sentinel.lr_factor=0.25"],
         "stability.sentinel.lr_factor is set but stability.sentinel.remedy=skip_window"),
        (["trainer.save_every=0", "trainer.save_every_minutes=0"],
         "stability.sentinel.enabled rolls back to checkpoints"),
        (["stability.sentinel.grad_norm_factor=1"],
         "stability.sentinel.grad_norm_factor must be > 1 (or 0), got 1.0"),
        (["stability.mismatch_budget.route_flips=1.5"],
         "stability.mismatch_budget.route_flips must be >= 0 and <= 1, got 1.5"),
        (["stability.sentinel.remedy=rewind"],
         "stability.sentinel.remedy='rewind' is not one of"),
    ],
)  # fmt: skip
def test_stability_settings_that_cannot_apply_are_refused(composer, overrides, message):
    with pytest.raises(ConfigError) as err:
        composer.resolve(*overrides)
    assert message in str(err.value)


def test_what_does_apply_composes(composer):
    composer.resolve(
        "stability.mismatch_budget.k3_kl=0.01", "stability.mismatch_budget.route_flips=0.1",
        "stability.mismatch_budget.remedy=mis", "algorithm.mismatch_level=geometric",
        "stability.sentinel.on_mismatch_budget=true",
    )  # fmt: skip
    composer.resolve(
        "stability.mismatch_budget.k3_kl=0.01", "rollout.mode=async", "rollout.max_staleness=3",
        "stability.mismatch_budget.remedy=lower_staleness",
    )  # fmt: skip
    composer.resolve("engine.entropy_metric=false", "stability.sentinel.entropy_fraction=0")
    composer.resolve("trainer.save_every=0", "stability.sentinel.enabled=false")


# -- telemetry -----------------------------------------------------------------------------------


@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
def test_route_flips_per_layer_are_zero_only_under_r3(composer, tokenizer, replay):
    """The fake rollout engine routes with a perturbed router: the trainer's old-policy forward
    disagrees with it unless it replays the rollout's experts (R3)."""
    run = fake_run(composer, tokenizer, f"algorithm.routing_replay={replay}")
    run.train()
    layers = run.cfg.model.model_config().num_hidden_layers
    for _, metrics in run.log.records:
        per_layer = [metrics[f"moe/route_flips/layer_{n}"] for n in range(layers)]
        assert metrics["moe/route_flips"] == pytest.approx(np.mean(per_layer))
        if replay == "r3":
            assert per_layer == [0.0] * layers
        else:
            assert all(f > 0.05 for f in per_layer), per_layer


def test_clip_fraction_by_version_lag_under_one_step_off(composer, tokenizer):
    """Batches generated a step ahead train with a lag of 1 (step 1's with 0); the clip fraction
    of each lag bucket is reported, and only of buckets that hold tokens."""
    run = fake_run(composer, tokenizer, "rollout.mode=one_step_off", "trainer.steps=3")
    run.train()
    (first, *later) = [m for _, m in run.log.records]
    assert first["actor/clip_fraction_lag_0"] == first["actor/clip_fraction"]
    assert "actor/clip_fraction_lag_1" not in first
    for metrics in later:
        assert metrics["actor/clip_fraction_lag_1"] == metrics["actor/clip_fraction"]
        assert "actor/clip_fraction_lag_0" not in metrics
        assert any(k.startswith("actor/clip_fraction_length_q") for k in metrics)


def test_step_metrics_carry_the_telemetry(composer, tokenizer):
    run = fake_run(composer, tokenizer, "trainer.steps=3")
    run.train()
    for step, metrics in run.log.records:
        for key in ("mismatch/k3_kl", "mismatch/tokens_past_threshold", "actor/grad_norm_max",
                    "stability/reward_ema", "stability/entropy_ema", "stability/grad_norm_ema",
                    "stability/signals_active", "moe/route_flips"):  # fmt: skip
            assert key in metrics, (step, key)
        assert metrics["mismatch/k3_kl"] > 0  # the fake rollout's log-probs carry noise
        assert metrics["actor/grad_norm_max"] >= metrics["actor/grad_norm"]
    # the reward's moving average: weight 1/window on each step
    rewards = [m["reward/mean"] for _, m in run.log.records]
    ema = rewards[0]
    for i, (_, metrics) in enumerate(run.log.records):
        ema = ema + (rewards[i] - ema) / 20 if i else ema
        assert metrics["stability/reward_ema"] == pytest.approx(ema)


# -- the collapse sentinel -------------------------------------------------------------------------


def test_a_corrupted_batch_rolls_back_with_the_remedy(composer, tokenizer):
    """Step 7 trains on a corrupted batch: the sentinel fires, the run goes back to step 4's
    checkpoint (step 6's is too recent: its rollouts are step 7's), moves the later checkpoints
    and records aside, skips the prompts of steps 5-7, halves the learning rate for 3 steps,
    draws new sampling seeds, and records every step once."""
    run = fake_run(composer, tokenizer, *WATCHED)
    skip_train_call(run, 13)  # step 7's first minibatch (2 per step)
    stream = PromptSampler(run.train_data, 4, seed=run.cfg.seed + run.cfg.data.seed)
    prompts_by_step = {step: [p.prompt_ids for p in stream.next_batch()] for step in range(1, 11)}
    run.train()
    assert steps_of(run) == list(range(1, 11))
    assert run.log.rewinds == [0, 4, 4]
    (record,) = run.checkpoints.history
    assert (record["fired_at"], record["since"], record["to_step"], record["status"]) == (
        7,
        7,
        4,
        "done",
    )
    assert "nonfinite" in record["signals"] and "1 of 2 optimizer steps skipped" in str(record)
    assert [s for s, _ in run.checkpoints.superseded] == [6]
    metrics = dict(run.log.records)
    assert metrics[5]["stability/rolled_back_from"] == 7
    assert all("stability/rolled_back_from" not in metrics[s] for s in (1, 2, 3, 4, 6, 7, 8))
    assert all(metrics[s]["stability/rollbacks"] == 1 for s in range(5, 11))
    # the learning rate: x0.5 for steps 5-7, back after
    lrs = {s: metrics[s]["actor/lr"] for s in metrics}
    base = run.policy.lr
    assert [lrs[s] for s in range(5, 11)] == [base * 0.5] * 3 + [base] * 3
    # the data window of steps 5-7 is skipped: step 5 draws what step 8 would have drawn
    generated = [c.prompts for c in run.journal.calls("generate")]
    after = generated[7:]  # 7 steps before the rollback
    assert [sorted(map(tuple, set(map(tuple, g)))) for g in after[:3]] == [
        sorted(set(map(tuple, prompts_by_step[s]))) for s in (8, 9, 10)
    ]
    # new sampling seeds after the rollback
    seeds = [c.params.seed for c in run.journal.calls("generate")]
    assert seeds[7] != seeds[4]  # step 5 again, another timeline


def test_a_reward_collapse_rolls_back_and_recovers(composer, tokenizer):
    """The policy collapses after step 5's update (it answers only "x"): from step 6 on the
    reward is 0, the sentinel fires after 2 steps, and the run goes on from step 4's checkpoint
    (healthy, and its following step 5 clean too) with the reward back up."""
    run = fake_run(composer, tokenizer, *REWARD_WATCHED)
    destroy_policy_at_train_call(run, 10, tokenizer)  # step 5's last update
    run.train()
    (record,) = run.checkpoints.history
    assert (record["fired_at"], record["since"], record["to_step"]) == (7, 6, 4)
    assert list(record["signals"]) == ["reward"]
    assert "below its moving average" in record["signals"]["reward"]
    rewards = {s: m["reward/mean"] for s, m in run.log.records}
    assert steps_of(run) == list(range(1, 11))
    assert min(rewards[s] for s in range(5, 11)) > 0.25


def test_without_a_checkpoint_before_the_signals_it_stops_with_a_clear_line(composer, tokenizer):
    run = fake_run(composer, tokenizer, *WATCHED)
    skip_train_call(run, 5)  # step 3: the only checkpoint, step 2, is too recent
    with pytest.raises(StabilityError) as err:
        run.train()
    assert str(err.value).startswith(
        "the collapse sentinel fired at step 3 (nonfinite: non-finite actor/loss"
    )
    assert "no healthy checkpoint of step 1 or earlier is there to roll back to: stopping" in str(
        err.value
    )
    assert run.checkpoints.history == []


def test_rollbacks_are_bounded_then_the_run_stops_loudly(composer, tokenizer):
    run = fake_run(composer, tokenizer, *WATCHED, "stability.sentinel.max_rollbacks=2")
    original, calls = run.policy.train_step, [0]

    def always_bad_after_step_6(samples, loss, **kwargs):
        calls[0] += 1
        if run.trainer.step >= 6:
            return {"loss": float("nan"), "grad_norm": float("nan"), "skipped": 1.0,
                    "lr": run.policy.current_lr(), "num_microbatches": 1.0}  # fmt: skip
        return original(samples, loss, **kwargs)

    run.policy.train_step = always_bad_after_step_6
    with pytest.raises(StabilityError) as err:
        run.train()
    message = str(err.value)
    assert "after 2 rollback(s), the most stability.sentinel.max_rollbacks=2 allows" in message
    assert "Rollbacks: step 7 -> 4 (nonfinite); step 7 -> 4 (nonfinite)" in message
    assert [r["status"] for r in run.checkpoints.history] == ["done", "done"]


def test_with_the_sentinel_off_it_only_reports(composer, tokenizer, capsys):
    run = fake_run(composer, tokenizer, *WATCHED, "stability.sentinel.enabled=false")
    skip_train_call(run, 13)
    run.train()
    assert steps_of(run) == list(range(1, 11)) and run.log.rewinds == [0]
    metrics = dict(run.log.records)
    assert metrics[7]["stability/sentinel_fired"] == 1.0
    assert "step 7: the collapse sentinel would roll back here" in capsys.readouterr().err
    assert run.checkpoints.history == []


class Killed(BaseException):
    """A process killed (kill -9): nothing after it runs."""


@pytest.mark.parametrize("where", ["after_record", "after_moving"])
def test_a_rollback_interrupted_and_resumed_ends_as_the_uninterrupted_one(
    composer, tokenizer, where
):
    """Killed right after the rollback is recorded, or after the checkpoints were moved aside
    (before the records are): the resumed run completes the rollback and ends with the same
    records as a run that was never interrupted, every step recorded once."""
    straight = fake_run(composer, tokenizer, *WATCHED)
    skip_train_call(straight, 13)
    straight.train()

    ckpts, log = MemoryCheckpoints(), MemoryLog()
    first = fake_run(composer, tokenizer, *WATCHED, checkpoints=ckpts, log=log)
    skip_train_call(first, 13)
    if where == "after_record":
        save = ckpts.save_rollbacks

        def save_then_die(records):
            save(records)
            if records[-1]["status"] == "started":
                raise Killed

        ckpts.save_rollbacks = save_then_die
    else:
        roll_back = ckpts.roll_back

        def roll_back_then_die(*args, **kwargs):
            roll_back(*args, **kwargs)
            raise Killed

        ckpts.roll_back = roll_back_then_die
    with pytest.raises(Killed):
        first.train()
    vars(ckpts).pop("save_rollbacks", None)  # the class's own methods again
    vars(ckpts).pop("roll_back", None)
    assert ckpts.history[-1]["status"] == "started"
    assert steps_of(first)[-1] == 7
    resumed = fake_run(composer, tokenizer, *WATCHED, checkpoints=ckpts, log=log)
    resumed.train()
    assert ckpts.history == straight.checkpoints.history
    assert stable(log.records) == stable(straight.log.records)
    assert [s for s, _ in log.records] == list(range(1, 11))


# -- the mismatch budget ---------------------------------------------------------------------------


BUDGET = ("trainer.steps=6", "stability.mismatch_budget.k3_kl=1e-6",
          "stability.mismatch_budget.window=2")  # fmt: skip


def test_budget_warn_says_so_with_the_numbers(composer, tokenizer, capsys):
    run = fake_run(composer, tokenizer, *BUDGET)
    run.train()
    over = [s for s, m in run.log.records if m["stability/mismatch_over_budget"]]
    assert over == [2, 4, 6]  # the window starts again after each action
    err = capsys.readouterr().err
    assert "step 2: mismatch budget exceeded: mismatch/k3_kl averaged" in err
    assert "over the last 2 steps, above stability.mismatch_budget.k3_kl=1e-06; remedy warn" in err
    assert dict(run.log.records)[6]["stability/mismatch_actions"] == 3


def test_budget_remedy_mis_turns_on_masked_importance_sampling(composer, tokenizer):
    run = fake_run(composer, tokenizer, *BUDGET, "stability.mismatch_budget.remedy=mis",
                   "algorithm.mismatch_level=geometric")  # fmt: skip
    run.train()
    trains = run.journal.calls("train")
    weighted = [all(s.is_weights is not None for s in c.samples) for c in trains]
    assert weighted == [False] * 4 + [True] * 8  # from step 3 on
    metrics = dict(run.log.records)
    assert [metrics[s]["stability/mis_on"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
    assert not any(k.startswith("mismatch/mismatch_") for k in metrics[2])
    assert any(k.startswith("mismatch/mismatch_") for k in metrics[3])  # MIS's own metrics
    # resumed from the newest checkpoint (saved with MIS on), MIS stays on
    cfg, model, layout = composer.resolve(
        *BUDGET, "stability.mismatch_budget.remedy=mis", "algorithm.mismatch_level=geometric",
        "trainer.steps=7",
    )  # fmt: skip
    ckpts = copy.deepcopy(run.checkpoints)
    again = build_fake_run(cfg, model, layout, tokenizer, checkpoints=ckpts)
    assert again.trainer.inputs.settings.mismatch == "none"
    again.train()
    assert again.trainer.inputs.settings.mismatch == "mis"


def test_budget_remedy_stop_checkpoints_then_stops(composer, tokenizer):
    run = fake_run(composer, tokenizer, *BUDGET, "stability.mismatch_budget.remedy=stop")
    with pytest.raises(StabilityError, match="step 2: mismatch budget exceeded.*remedy stop"):
        run.train()
    assert sorted(run.checkpoints.saved) == [2]


def test_budget_remedy_lower_staleness(composer, tokenizer):
    run = fake_run(composer, tokenizer, *BUDGET, "rollout.mode=async", "rollout.max_staleness=3",
                   "stability.mismatch_budget.remedy=lower_staleness")  # fmt: skip
    run.train()
    metrics = dict(run.log.records)
    assert [metrics[s]["stability/max_staleness"] for s in range(1, 7)] == [3, 2, 2, 1, 1, 1]
    assert run.trainer.collector.settings.max_staleness == 1
    assert run.trainer.collector.pipeline.max_staleness == 1
