"""The reproduction commands (benchmarks/reproduce/) and the TRL benchmark's loss check.

The smoke test runs every experiment command for 2 steps with small batches; the runs are shared
between experiments, so the six methods train once and the other commands only report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO

REPRODUCE = REPO / "benchmarks" / "reproduce"


def _module(name: str):
    sys.path.insert(0, str(REPRODUCE))
    try:
        spec = importlib.util.spec_from_file_location(f"reproduce_{name}", REPRODUCE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPRODUCE))


def _fake_run(directory: Path, steps: int, reward: float, clip: float, route: float) -> None:
    directory.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "reward/mean": reward * step / steps,
            "reward/accuracy": 0.0,
            "actor/clip_fraction": clip,
            "moe/route_change_fraction": route,
            "time/step": 0.1,
        }
        if step % 10 == 0:
            record["eval/pass@1"] = record["eval/reward_mean"] = reward * step / steps
        lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_mean_and_spread_over_seeds(tmp_path):
    report = _module("report")
    out = tmp_path / "runs"
    for seed, reward in ((0, 0.6), (1, 0.8)):
        _fake_run(out / "gspo" / f"seed{seed}", 40, reward, clip=0.2, route=0.05)
    _fake_run(out / "grpo" / "seed0", 40, 0.5, clip=0.001, route=0.1)
    (out / "grpo" / "seed1").mkdir(parents=True)  # unfinished: no metrics
    written = report.write_report("clipping", out, [0, 1], 40, tmp_path / "figures")
    names = {p.name for p in written}
    assert {"clipping_clip_fraction.png", "clipping_reward.png", "clipping_summary.md"} <= names
    summary = json.loads((out / "clipping_summary.json").read_text())["methods"]
    assert summary["gspo"]["seeds"] == [0, 1] and summary["grpo"]["seeds"] == [0]
    held = summary["gspo"]["stats"]["heldout_final"]
    per_seed = [statistics.fmean([r * s / 40 for s in (20, 30, 40)]) for r in (0.6, 0.8)]
    assert held["mean"] == pytest.approx(statistics.fmean(per_seed))
    assert held["std"] == pytest.approx(statistics.stdev(per_seed))
    assert summary["grpo"]["stats"]["clip_fraction"]["mean"] == pytest.approx(0.001)
    assert summary["gspo"]["stats"]["steps_to_heldout_0.5"]["mean"] == pytest.approx(35.0)
    text = (out / "clipping_summary.md").read_text()
    assert "Not finished yet: grpo seed 1" in text
    # An unfinished run (fewer steps than asked) does not count as done.
    assert not report.run_complete(out / "gspo" / "seed0", 50)
    assert report.run_complete(out / "gspo" / "seed0", 40)


def test_comparisons_are_decided_by_a_test_over_seeds(tmp_path):
    """The powered experiment's verdicts: a claim "A > B" holds when the permutation test over
    seeds puts A above B, does not hold when the two are equivalent within the margin (or A is
    below), and is undecided otherwise; a noise control holds when its methods are equivalent."""
    report = _module("report")
    out = tmp_path / "powered"
    levels = {"gspo": 0.8, "gspo_token": 0.8, "grpo": 0.5, "grpo_rr": 0.5, "ppo": 0.9}
    for method, level in levels.items():
        for seed in range(4):
            # seeds spread by +-0.01 (+-0.2 for ppo: noise that hides its lead)
            spread = (0.2 if method == "ppo" else 0.01) * (seed - 1.5)
            _fake_run(out / method / f"seed{seed}", 20, level + spread, clip=0.1, route=0.01)
    report.write_report("powered", out, [0, 1, 2, 3], 20, tmp_path / "figures")
    decided = json.loads((out / "powered_summary.json").read_text())["comparisons"]
    verdicts = {(d["a"], d["b"], d["quantity"]): d for d in decided}
    auc = "reward_mean_all_steps"
    gspo_grpo = verdicts[("gspo", "grpo", auc)]
    assert gspo_grpo["verdict"] == "holds" and gspo_grpo["p"] == pytest.approx(2 / 70)
    assert gspo_grpo["difference"] == pytest.approx(0.3 * statistics.fmean(range(1, 21)) / 20)
    control = verdicts[("gspo", "gspo_token", auc)]
    assert control["verdict"] == "holds (equal within the margin)"
    assert -0.05 < control["tost_ci_low"] <= control["tost_ci_high"] < 0.05
    replay = verdicts[("grpo_rr", "grpo", auc)]
    assert replay["verdict"] == "does not hold (equal within the margin)"
    assert verdicts[("gspo", "grpo_rr", auc)]["verdict"] == "holds (A > B)"  # A >= B
    ppo = verdicts[("ppo", "gspo", auc)]
    assert ppo["verdict"] == "undecided" and ppo["seeds_for_power_0.8"] > 4
    text = (out / "powered_summary.md").read_text()
    assert "| (a) GSPO learns more per sample than GRPO | reward_mean_all_steps |" in text


def test_experiments_use_equal_work_per_method():
    experiments = _module("experiments")
    for method in experiments.METHODS.values():
        keys = {o.split("=")[0] for o in method.overrides}
        # Methods differ only in algorithm settings: same data, rollout, optimizer and steps.
        assert keys <= {"algorithm", "algorithm.routing_replay"}, method
    assert "algorithm.num_minibatches=4" in experiments.COMMON
    for name, experiment in experiments.EXPERIMENTS.items():
        assert set(experiment.methods) <= set(experiments.METHODS), name


def _run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(REPRODUCE / "run.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"run.py {args} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-5000:]}"
        )
    return proc


@pytest.mark.slow
def test_every_reproduction_command_runs(tmp_path, capsys):
    out = tmp_path / "runs"
    common = ["--smoke", "--steps", "2", "--seeds", "0", "--out", str(out)]
    first = _run(["all", "--jobs", "2", *common])  # one-thread runs: two at once on two cores
    assert "6 run(s) to train" in first.stdout
    run = _module("run")
    for name in ("efficiency", "clipping", "routing_replay", "baseline"):
        # In this process: these commands only report, a process each would add only start-up.
        assert run.main([name, *common]) == 0
        stdout = capsys.readouterr().out
        assert "0 run(s) to train" in stdout, stdout  # shared runs, not retrained
        assert (out / f"{name}_summary.json").is_file()
        assert (out / "figures" / f"{name}_reward.png").is_file()
    summary = json.loads((out / "all_summary.json").read_text())["methods"]
    assert set(summary) == {"gspo", "grpo", "grpo_rr", "gspo_token", "sapo", "ppo"}
    for method in summary:
        records = [
            json.loads(line)
            for line in (out / method / "seed0" / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records] == [1, 2]
        for key in ("reward/mean", "actor/clip_fraction", "moe/route_change_fraction"):
            assert key in records[-1], (method, key)
        assert "eval/pass@1" in records[-1]
        assert ("critic/explained_variance" in records[-1]) == (method == "ppo")
    assert (out / "figures" / "baseline_explained_variance.png").is_file()
    config = json.loads((out / "grpo_rr" / "seed0" / "run_config.json").read_text())
    assert config["algorithm"]["routing_replay"] == "r2"
    assert config["algorithm"]["num_minibatches"] == 4


@pytest.mark.slow
def test_bench_vs_trl_losses_agree(tmp_path):
    """Needs TRL (not a project dependency): TRL's GSPO loss (loss_type grpo), ours and the
    paper's formula by hand agree on one batch; TRL's default aggregation (dapo) does not."""
    pytest.importorskip("trl")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_vs_trl.py", "--skip-training", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    report = json.loads((tmp_path / "bench_vs_trl.json").read_text())["loss"]
    losses = report["losses"]
    paper = losses.pop("paper formula (float64, HF log-probs)")
    dapo = [v for k, v in losses.items() if "dapo" in k]
    agree = {k: v for k, v in losses.items() if "dapo" not in k}
    assert len(agree) == 4 and len(dapo) == 1
    for name, value in agree.items():
        assert value == pytest.approx(paper, rel=1e-5, abs=1e-8), name
    assert abs(dapo[0] - paper) > 1e-4  # token-weighted: differs when lengths differ
    assert report["batch"]["grad_rel_diff_trl_grpo_vs_ours"] < 1e-4
    assert 0 < report["batch"]["seq_clip_fraction"] < 1
