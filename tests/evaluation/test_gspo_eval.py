"""gspo-eval's refusals: what it needs and vocabularies that disagree, before anything generates.
(gspo-eval against the loop's own evaluation: tests/trainer/test_train_e2e.py,
test_default_run_learns; on two ranks under the emulated accelerator:
tests/device/test_emulated_train.py.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from launch import REPO, gspo_train_env, hf_policy

from gspo_megatron.config import compose
from gspo_megatron.evaluate import evaluate_composed, summary_table


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "model.init_from is null: gspo-eval evaluates a checkpoint"),
        (
            ["model.init_from=README.md", "eval.heldout.problems=0"],
            "nothing to evaluate: eval.heldout.problems=0 and eval.benchmarks is empty",
        ),
        (["model.init_from=README.md", "rollout.eval_samples=2"], "is now eval.heldout.samples"),
    ],
)
def test_what_gspo_eval_needs_is_named(overrides, message, tmp_path):
    with pytest.raises(BaseException, match=message) as err:
        evaluate_composed(compose(overrides), tmp_path)
    if err.type is SystemExit:
        assert str(err.value).startswith("gspo-eval: config error: ")


def test_no_training_data_is_needed(tmp_path):
    """A named benchmark alone: the data section may name no training prompts."""
    with pytest.raises(SystemExit, match="model.init_from is null"):
        evaluate_composed(compose(["data=jsonl", "eval.heldout.problems=0"]), tmp_path)


@pytest.mark.parametrize(
    ("changes", "overrides", "message"),
    [
        # the char tokenizer has 48 ids: a model of 32 cannot embed them
        ({}, ["model.vocab_size=32"], "vocab"),
        # a checkpoint of 128 ids for the model of 48
        ({"vocab_size": 128}, [], "model.init_from=.*vocab_size"),
    ],
    ids=["tokenizer-larger-than-model", "checkpoint-differs-from-model"],
)
def test_vocabularies_that_disagree_are_refused_before_generation(
    tmp_path, changes, overrides, message
):
    hf = hf_policy(tmp_path / "hf", **changes)
    cmd = [sys.executable, "-m", "gspo_megatron.evaluate", f"hydra.run.dir={tmp_path / 'out'}",
           f"model.init_from={hf}", *overrides]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=gspo_train_env(), cwd=REPO
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gspo-eval")]
    assert len(lines) == 1 and re.search(message, lines[0]), proc.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_summary_table_has_a_row_per_benchmark_and_a_column_per_metric():
    table = summary_table(
        {"a": {"avg@4": 0.5, "pass@4": 0.75}, "b": {"avg@1": 1.0, "pass@1": 1.0}}
    ).splitlines()
    assert table[0] == "| benchmark | avg@1 | avg@4 | pass@1 | pass@4 |"
    assert table[2] == "| a |  | 0.5 |  | 0.75 |" and table[3] == "| b | 1 |  | 1 |  |"
