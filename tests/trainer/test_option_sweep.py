"""Option combinations through gspo-train's own code (compose -> validate -> build -> 2 steps):
every combination either trains or is refused before any model is built, naming its keys.

Numbers are checked elsewhere against float64 references (tests/algorithms for the weighted
losses, tests/trainer/test_trainer_options.py for the loop); here every combination runs on the
real megatron engine, embedded rollouts and checkpointing.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from launch import finish_worker, start_worker

from gspo_megatron.algorithms.losses import POLICY_LOSSES

WORKER = Path(__file__).resolve().parent / "option_sweep_worker.py"
SEQUENCE_RATIO_LOSSES = {"gspo", "gmpo"}
# Worker processes side by side, one per core of a CI machine; each runs its share of the
# combinations one after another in-process (runs free their engines and process groups:
# TrainingEngine.close; measured 61 s for both sweeps vs 137 s in four processes one after
# another, when each run left its gloo threads behind).
PARTS = 2


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[str, list[dict]]:
    """Both sweeps' results by sweep name."""
    out = tmp_path_factory.mktemp("sweeps")
    results: dict[str, list[dict]] = {"mismatch": [], "sampling": []}
    procs = [
        start_worker(WORKER, ["--sweep", "all", "--part", f"{i}/{PARTS}", "--out", str(out)])
        for i in range(PARTS)
    ]
    for proc in procs:
        for result in finish_worker(proc, timeout=900):
            results[result.pop("sweep")].append(result)
    return results


def settings(result: dict) -> dict[str, str]:
    return dict(o.split("=", 1) for o in result["overrides"])


def assert_trained(result: dict) -> list[dict]:
    """The steps that trained (two optimizer steps, a finite loss); a step whose dynamic sampling
    found no informative group trains nothing, and says so."""
    assert result["status"] == "trained", result
    steps = result["steps"]
    assert len(steps) == 2, result
    trained = []
    for step in steps:
        if step["sampling/groups_used"] == 0:
            assert "dynamic_sampling=none" not in " ".join(result["overrides"]), result
            assert step["actor/optimizer_steps"] == 0 and "actor/loss" not in step, result
            continue
        assert math.isfinite(step["actor/loss"]), result
        assert step["actor/optimizer_steps"] == 2, result
        trained.append(step)
    assert trained, result
    return trained


@pytest.mark.slow
def test_runs_in_one_process_free_their_process_groups(sweeps):
    """Each in-process run used to leave ~60 gloo threads behind (its engine never freed:
    reference cycles through autograd nodes), and later runs slowed down with their number."""
    threads = [r["threads"] for r in sweeps["mismatch"] + sweeps["sampling"]]
    assert max(threads) - min(threads) <= 4 * len(threads) // PARTS, threads


def test_loss_mismatch_level_sweep(sweeps):
    """Every loss x mismatch {none, tis, mis} x level {token, sequence, geometric} (ppo with
    its preset: a critic and GAE)."""
    results = sweeps["mismatch"]
    assert len(results) == len(POLICY_LOSSES) * 7
    refused = []
    for result in results:
        s = settings(result)
        if s["algorithm"] in SEQUENCE_RATIO_LOSSES and s.get("algorithm.mismatch_level") == "token":
            assert result["status"] == "refused", result
            message = result["message"]
            for key in ("algorithm.mismatch=", "algorithm.mismatch_level=token", "algorithm.loss="):
                assert key in message, message
            assert "one importance weight per sequence" in message, message
            refused.append(s["algorithm"])
        else:
            for step in assert_trained(result):
                assert ("critic/loss" in step) == (s["algorithm"] == "ppo"), result
    assert sorted(refused) == ["gmpo", "gmpo", "gspo", "gspo"]


@pytest.mark.slow
def test_old_logprobs_replay_kl_sampling_sweep(sweeps):
    """old_logprobs {recompute, rollout} x routing_replay {off, r2, r3} x kl_coef {0, 0.1} x
    dynamic_sampling {none, dapo, dupo}: all train."""
    results = sweeps["sampling"]
    assert len(results) == 2 * 3 * 2 * 3
    for result in results:
        s = settings(result)
        for step in assert_trained(result):
            assert ("actor/kl_ref" in step) == (float(s["algorithm.kl_coef"]) > 0), result
            # Route metrics ride on a forward that runs anyway, or on the rollout's routes (R3).
            routes_seen = s["algorithm.old_logprobs"] == "recompute" or s[
                "algorithm.routing_replay"
            ] in ("r2", "r3")
            assert ("moe/max_expert_load_over_mean" in step) == routes_seen, result
