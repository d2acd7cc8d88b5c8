"""The stability telemetry through `gspo-train` on the embedded engine: per-layer route flips
between the rollout engine and the trainer are 0 at every layer under R3 and not without replay
(rollout.mode=one_step_off: the generator process samples with weights a version older), with
the replay coverage, the k3 mismatch and the clip fraction by version lag beside them."""

from __future__ import annotations

import subprocess

import pytest
from launch import REPO, gspo_train_command, gspo_train_env, read_metrics

TINY = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.mode=one_step_off",
    "trainer.steps=3",
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One run with R3 and one without replay, side by side."""
    root = tmp_path_factory.mktemp("route_flips")
    procs = {
        replay: subprocess.Popen(
            gspo_train_command(root / replay, [*TINY, f"algorithm.routing_replay={replay}"]),
            env=gspo_train_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for replay in ("r3", "off")
    }
    for proc in procs.values():
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, out[-3000:]
    return {replay: read_metrics(root / replay) for replay in procs}


@pytest.mark.slow
def test_route_flips_are_zero_at_every_layer_under_r3_only(runs):
    layers = 2  # model tiny_moe
    for replay, records in runs.items():
        assert [r["step"] for r in records] == [1, 2, 3]
        for record in records:
            flips = [record[f"moe/route_flips/layer_{n}"] for n in range(layers)]
            assert record["moe/replay_coverage"] == (1.0 if replay == "r3" else 0.0)
            assert record["mismatch/k3_kl"] >= 0.0
            if replay == "r3" or record["step"] == 1:  # step 1: the same weights
                assert flips == [0.0] * layers, (replay, record["step"], flips)
            else:
                assert all(f > 0 for f in flips), (replay, record["step"], flips)
    # a version older: a mismatch the k3 estimate sees, and a lag-1 clip fraction
    later = runs["off"][1:]
    assert all(r["mismatch/k3_kl"] > 0 for r in later)
    assert all("actor/clip_fraction_lag_1" in r for r in later)
