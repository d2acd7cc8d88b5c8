"""The stability pieces alone: the collapse sentinel's signals, baselines and state, the
rollback target rule and learning-rate windows, the mismatch budget's windows and remedies, and
what the run directory keeps (the newest healthy checkpoint, superseded evaluation records)."""

from __future__ import annotations

import json
import math

import pytest

from gspo_megatron.config import MismatchBudgetSection, SentinelSection
from gspo_megatron.run_files import MetricsLogger, RunCheckpoints
from gspo_megatron.stability import (
    CollapseSentinel,
    MismatchBudget,
    RollbackRecord,
    Rollbacks,
    may_roll_back_to,
)


def healthy(reward=0.8, entropy=1.0, grad=1.0):
    return {
        "reward/mean": reward, "actor/entropy": entropy, "actor/grad_norm_max": grad,
        "actor/loss": 0.1, "actor/skipped_steps": 0.0, "actor/optimizer_steps": 4.0,
    }  # fmt: skip


def sentinel(**overrides) -> CollapseSentinel:
    return CollapseSentinel(SentinelSection(**{"warmup_steps": 3, "window": 4, **overrides}))


def test_each_signal_fires_after_its_patience_with_its_numbers():
    cases = {
        "reward": ({"reward/mean": 0.1}, 5, "reward/mean 0.1 is 0.7 below its moving average 0.8"),
        "entropy": ({"actor/entropy": 0.05}, 5,
                    "actor/entropy 0.05 is 0.05 of its moving average 1"),
        "grad_norm": ({"actor/grad_norm_max": 50.0, "reward/mean": 0.75}, 3,
                      "actor/grad_norm_max 50 is 50x its moving average 1 (stability.sentinel"
                      ".grad_norm_factor=10) while reward/mean 0.75 is below its moving average"
                      " 0.8"),
        "nonfinite": ({"actor/loss": math.nan, "actor/skipped_steps": 1.0}, 2,
                      "non-finite actor/loss, 1 of 4 optimizer steps skipped"),
    }  # fmt: skip
    for name, (bad, patience, text) in cases.items():
        s = sentinel()
        for step in range(1, 6):
            assert s.observe(step, healthy())[1] is None
        for k in range(patience):
            out, firing = s.observe(6 + k, healthy() | bad)
            assert (firing is None) == (k < patience - 1), (name, k)
        assert list(firing.signals) == [name] and firing.since == 6 and firing.step == 5 + patience
        assert text in firing.signals[name], firing.signals[name]
        assert out["stability/sentinel_fired"] == 1.0 and s.health()["suspect_since"] == 6
        # a collapse that persists fires once; after a clean step, the next one fires again
        for step in range(6 + patience, 16 + patience):
            assert s.observe(step, healthy() | bad)[1] is None
        assert s.observe(16 + patience, healthy())[1] is None and not s.holding
        firings = [s.observe(17 + patience + k, healthy() | bad)[1] for k in range(patience)]
        assert firings[-1] is not None and firings[-1].since == 17 + patience


def test_signals_wait_for_the_warmup_but_non_finite_values_do_not():
    s = sentinel(warmup_steps=10)
    s.observe(1, healthy())
    for step in range(2, 10):
        assert s.observe(step, healthy(reward=0.0))[1] is None  # not yet watched
    s = sentinel(nonfinite_patience=1)
    assert s.observe(1, healthy() | {"reward/mean": math.inf})[1].signals["nonfinite"] == (
        "non-finite reward/mean"
    )


def test_baselines_hold_still_while_a_signal_runs_and_travel_with_the_state():
    s = sentinel()
    for step in range(1, 6):
        s.observe(step, healthy())
    before = dict(s.baselines)
    s.observe(6, healthy(reward=0.3))  # a reward streak starts: the baselines keep still
    assert s.baselines == before
    assert s.health() == {
        "healthy": False,
        "suspect_since": 6,
        "signals": {"reward": s.streaks["reward"][2]},
    }
    copy = sentinel()
    copy.load_state_dict(json.loads(json.dumps(s.state_dict())))  # as a checkpoint keeps it
    assert copy.state_dict() == s.state_dict()
    s.observe(7, healthy())  # the streak ends, the baselines move again
    assert s.health() == {"healthy": True} and s.baselines["reward"] == pytest.approx(0.8)


def test_signals_off_and_a_zero_gradient_baseline_stay_quiet():
    s = sentinel(reward_drop=0, entropy_fraction=0, grad_norm_factor=0, nonfinite_patience=0)
    for step in range(1, 20):
        bad = healthy(reward=0.0, entropy=1e-6, grad=1e6) | {"actor/loss": math.nan}
        assert s.observe(step, healthy() if step < 5 else bad)[1] is None
    s = sentinel()
    for step in range(1, 8):  # every group solved: no gradient at all
        s.observe(step, healthy(grad=0.0))
    assert s.observe(8, healthy(grad=5.0))[0]["stability/signals_active"] == 0


@pytest.mark.parametrize("key", ["advantage/abs_mean", "advantage/token_abs_mean"])
def test_steps_without_advantages_leave_the_gradient_baseline_alone(key):
    """A converged run: most steps every group is solved alike (advantages 0, gradient 0), now
    and then one sample fails and the gradient is its usual size (a run of 2026-12-03 stopped
    after three rollbacks on this pattern, docs/STABILITY.md)."""
    solved = healthy(grad=0.0) | {key: 0.0}
    one_failed = healthy(grad=3.0) | {key: 0.06}
    s = sentinel()
    for step in range(1, 6):
        s.observe(step, one_failed)
    for step in range(6, 40):
        s.observe(step, solved)
    assert s.baselines["grad_norm"] == pytest.approx(3.0)
    for step in range(40, 44):  # three in a row: the patience
        assert s.observe(step, one_failed)[0]["stability/signals_active"] == 0
    spike = healthy(grad=50.0, reward=0.7) | {key: 0.06}
    fired = [s.observe(step, spike)[1] for step in range(44, 47)]
    assert fired[-1] is not None and "grad_norm" in fired[-1].signals
    # without the advantages reported, every step moves the baseline as before
    s = sentinel()
    for step in range(1, 40):
        s.observe(step, healthy(grad=0.0 if step > 5 else 3.0))
    assert s.baselines["grad_norm"] < 0.01


def test_a_converged_policy_near_determinism_and_its_rare_failures_stay_quiet():
    """Two LoRA runs of 2026-12-04 (docs/STABILITY.md) at reward ~0.9, stopped after three
    rollbacks: entropy moving between 0.0005 and 0.04 nats (its average ~0.02), and gradient
    norms of 5-28 against an average of 0.3-0.8 on the steps where a sample failed."""
    s = sentinel()
    for step in range(1, 6):
        s.observe(step, healthy(reward=0.9, entropy=0.02, grad=0.5))
    noise = healthy(reward=0.95, entropy=0.0006, grad=25.0)  # a failure among successes
    for step in range(6, 16):
        assert s.observe(step, noise)[0]["stability/signals_active"] == 0
    # the same steps, each signal watched as before the two rules
    s = sentinel(entropy_floor=0, grad_norm_requires_reward_dip=False)
    for step in range(1, 6):
        s.observe(step, healthy(reward=0.9, entropy=0.02, grad=0.5))
    fired = [s.observe(step, noise)[1] for step in range(6, 11)]
    assert fired[:2] == [None, None] and set(fired[2].signals) == {"grad_norm"}
    assert set(s.streaks) == {"entropy", "grad_norm"}
    # above the floor the entropy signal watches; a gradient spike while the reward dips fires
    s = sentinel()
    for step in range(1, 6):
        s.observe(step, healthy(reward=0.9, entropy=0.5, grad=0.5))
    fired = [
        s.observe(step, healthy(reward=0.85, entropy=0.01, grad=25.0))[1] for step in range(6, 11)
    ]
    assert set(fired[2].signals) == {"grad_norm"} and fired[4] is None  # holding: fired once
    assert set(s.streaks) == {"entropy", "grad_norm"}


@pytest.mark.parametrize(
    "step, health, since, ok",
    [
        (4, {"healthy": True}, 6, True),
        (5, {"healthy": True}, 6, False),  # step 6's rollouts came from its weights
        (4, {"healthy": False, "suspect_since": 3}, 6, False),
        (4, None, 6, True),  # saved by an earlier version: no health recorded
    ],
)
def test_rollback_target_rule(step, health, since, ok):
    assert may_roll_back_to(step, health, since) is ok


def test_learning_rate_windows_multiply_and_skip_abandoned_rollbacks():
    r = Rollbacks(SentinelSection(), checkpoints=None, log=None)
    record = dict(fired_at=9, since=8, checkpoint="step_000006", signals={}, remedy="lower_lr")
    r.history = [
        RollbackRecord(index=1, to_step=6, lr_factor=0.5, lr_steps=4, status="done", **record),
        RollbackRecord(index=2, to_step=8, lr_factor=0.5, lr_steps=4, status="done", **record),
        RollbackRecord(index=3, to_step=0, lr_factor=0.1, lr_steps=99, status="abandoned",
                       **record),
    ]  # fmt: skip
    assert [r.lr_scale(s) for s in range(6, 14)] == [1, 0.5, 0.5, 0.25, 0.25, 0.5, 0.5, 1]
    assert r.timeline == 3


def test_budget_window_remedies_and_state():
    budget = MismatchBudget(
        MismatchBudgetSection(k3_kl=0.01, window=3, remedy="lower_staleness"), max_staleness=3
    )
    steps = [budget.observe(s, {"mismatch/k3_kl": v}) for s, v in enumerate([0.02, 0.005], 1)]
    assert [a for _, a in steps] == [None, None]  # a window of 3 steps is not full yet
    out, action = budget.observe(3, {"mismatch/k3_kl": 0.002})
    assert action is None and out["stability/k3_kl_window_mean"] == pytest.approx(0.009)
    out, action = budget.observe(4, {"mismatch/k3_kl": 0.03})
    assert action.remedy == "lower_staleness" and budget.max_staleness == 2
    assert "mismatch/k3_kl averaged 0.01233 over the last 3 steps, above" in action.message
    assert "rollout.max_staleness lowered to 2" in action.message
    for step in (5, 6, 7):
        out, action = budget.observe(step, {"mismatch/k3_kl": 0.5})
    assert budget.max_staleness == 1
    for step in (8, 9, 10):
        out, action = budget.observe(step, {"mismatch/k3_kl": 0.5})
    assert action.remedy == "warn" and "is 1 already" in action.message
    again = MismatchBudget(budget.settings, max_staleness=3)
    again.load_state_dict(json.loads(json.dumps(budget.state_dict())))
    assert again.state_dict() == budget.state_dict() and again.actions == 3


def test_budget_mis_is_turned_on_once():
    budget = MismatchBudget(
        MismatchBudgetSection(route_flips=0.1, window=1, remedy="mis"), max_staleness=1
    )
    first = budget.observe(1, {"moe/route_flips": 0.2})[1]
    second = budget.observe(2, {"moe/route_flips": 0.2})[1]
    assert (first.remedy, second.remedy) == ("mis", "warn") and budget.mis_on
    assert "MIS is on already" in second.message
    assert MismatchBudget(MismatchBudgetSection(), 1).observe(1, {"mismatch/k3_kl": 9.0}) == (
        {},
        None,
    )


def fake_checkpoint(run_dir, step: int, health: dict | None) -> None:
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    extra = {"step": step} if health is None else {"step": step, "health": health}
    (path / "gspo_checkpoint.json").write_text(json.dumps({"model": {}, "extra": extra}))


def test_rotation_keeps_the_newest_healthy_checkpoint(tmp_path):
    fake_checkpoint(tmp_path, 2, {"healthy": True})
    fake_checkpoint(tmp_path, 4, {"healthy": True})
    fake_checkpoint(tmp_path, 6, {"healthy": False, "suspect_since": 5})
    fake_checkpoint(tmp_path, 8, {"healthy": False, "suspect_since": 5})
    RunCheckpoints(tmp_path, keep_last=2)._rotate(8)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000004", "step_000006", "step_000008",
    ]  # fmt: skip
    fake_checkpoint(tmp_path, 10, None)  # no health recorded: counts as healthy
    RunCheckpoints(tmp_path, keep_last=2)._rotate(10)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000008", "step_000010",
    ]  # fmt: skip


def test_rewinding_the_metrics_moves_later_evaluation_records_aside(tmp_path):
    from gspo_megatron.config import RunConfig

    cfg = RunConfig()
    cfg.logging.progress = False
    log = MetricsLogger(tmp_path, cfg, total_steps=10, enabled=True)
    for step in (1, 2, 3):
        log.write(step, {"reward/mean": 0.1 * step})
        log.write_records(step, "heldout", [{"step": step}])
    log.rewind(1)
    assert [
        json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [1]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["step_000001", "superseded"]
    moved = sorted(p.name.split(".")[0] for p in (tmp_path / "eval" / "superseded").iterdir())
    assert moved == ["step_000002", "step_000003"]
    log.write(2, {"reward/mean": 0.5})  # TensorBoard goes on, the old step 2 purged
    log.close()
