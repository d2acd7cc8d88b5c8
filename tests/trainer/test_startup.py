"""What gspo-train imports before it answers: --help and config errors come before megatron-core,
transformers and the model are loaded (their imports cost seconds of every command's start;
benchmarks/bench_startup.py measures it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launch import REPO, gspo_train_env

HEAVY = ("torch", "megatron.core", "transformers")


def imported_by(args: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """gspo-train ARGS in a fresh process; which of HEAVY it imported (python -X importtime)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gspo_megatron.train",
         f"hydra.run.dir={tmp_path / 'run'}", *args],
        capture_output=True, text=True, env=gspo_train_env(), cwd=REPO, timeout=300,
    )  # fmt: skip
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    return proc, {name for name in HEAVY if name in names}


def test_help_lists_the_groups_and_the_config_without_loading_torch(tmp_path):
    proc, heavy = imported_by(["--help", "algorithm=grpo", "rollout.group_size=4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "== Configuration groups ==" in out and "== Config ==" in out
    assert "algorithm: cispo, dapo, dr_grpo" in out and "model: moe_1b" in out
    assert "hydra:" not in out.split("== Config ==")[0]  # Hydra's own groups stay behind
    assert "loss: grpo" in out and "group_size: 4" in out  # the overrides, composed
    assert heavy == set()
    assert not (tmp_path / "run").exists()


def test_a_config_error_comes_before_megatron_and_transformers(tmp_path):
    proc, heavy = imported_by(["optimizer.lr=-1"], tmp_path)
    assert proc.returncode == 1
    assert "gspo-train: config error: optimizer.lr must be >= 0, got -1.0" in proc.stderr
    # torch itself is read by the loss registry the checks consult
    assert heavy <= {"torch"}


def test_a_key_of_an_earlier_version_is_refused_by_name_before_hydra(tmp_path):
    proc, heavy = imported_by(["--help", "trainer.lr=1e-4"], tmp_path)
    assert proc.returncode == 1
    assert "trainer.lr is now optimizer.lr" in proc.stderr
    assert heavy == set()


@pytest.mark.parametrize(
    "override, message",
    [
        ("bogus.key=1", "Could not override 'bogus.key'. To append to your config use +bogus"),
        ("optimizer.lr=abc", "optimizer.lr=abc (Value 'abc' of type 'str' could not be converted"),
        ("algorithm=nope", "Could not find 'algorithm/nope' Available options in 'algorithm':"),
    ],
)
def test_help_with_a_bad_override_says_why_in_one_line(tmp_path, override, message):
    proc, _ = imported_by(["--help", override], tmp_path)
    assert proc.returncode == 1
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith("gspo-train: config error: ")
    assert message in lines[0]
