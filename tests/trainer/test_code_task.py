"""The synthetic code task (data.task=expr, reward=code) through the trainer: with fake engines
(the real loop, scorer and sandbox; every step's reward checked against an independent
computation), and end to end through gspo-train and gspo-eval (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from launch import REPO, gspo_train, read_metrics
from sandbox_host import requires_sandbox
from trainer.fakes import build_fake_run

from gspo_megatron.data.synthetic import synthetic_records
from gspo_megatron.data.tokenizer import load_tokenizer

pytestmark = [requires_sandbox, pytest.mark.usefixtures("one_thread")]

CODE_TASK = (
    "reward=code",
    "data.task=expr",
    "model.tokenizer=char_expr",
    "model.vocab_size=16",
    "data.task_kwargs.max_digits=2",
    "rollout.max_new_tokens=3",
    "reward.kwargs.scoring=partial",
    "reward.kwargs.memory_mb=256",
)


def expected_reward(response: str, number: int, max_chars: int) -> float:
    """The code reward of `response` on the prompt `number=`, computed here: the printed value
    of the expression (evaluated in this process: the responses hold only digits, + and =),
    position by position against the number's line, scaled down when the expression is longer than
    the number; 0 for no program or invalid Python."""
    if not response:
        return 0.0
    assert re.fullmatch(r"[0-9+=]+", response), response
    try:
        value = eval(compile(response, "<response>", "eval"), {"__builtins__": {}})
    except SyntaxError:
        return 0.0
    printed, want = f"{value}\n", f"{number}\n"  # as print writes them
    credit = sum(a == b for a, b in zip(printed, want, strict=False))
    return credit / max(len(printed), len(want)) * min(1.0, max_chars / len(response))


def test_the_code_task_through_the_trainers_loop(composer):
    tokenizer = load_tokenizer("char_expr")
    cfg, model, layout = composer.resolve(*CODE_TASK, "trainer.steps=3")
    run = build_fake_run(cfg, model, layout, tokenizer)
    run.train()
    responses_per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    generated = run.journal.calls("generate")
    assert len(generated) == len(run.log.records) == 3
    for call, (_, metrics) in zip(generated, run.log.records, strict=True):
        rewards = []
        for prompt_ids, group in zip(call.prompts, call.groups, strict=True):
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
            number = int(prompt.rstrip("="))
            for sample in group:
                response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
                rewards.append(expected_reward(response, number, max_chars=2))
        assert metrics["reward/mean"] == pytest.approx(
            sum(rewards) / len(rewards), rel=1e-6
        )  # float32
        reasons = {k: v for k, v in metrics.items() if k.startswith("reward/code/")}
        outcomes = sum(v for k, v in reasons.items() if k != "reward/code/cache_hits")
        assert outcomes == responses_per_step and metrics["reward/failures"] == 0
    run.trainer.scorer.close()


@pytest.mark.slow
def test_gspo_train_and_gspo_eval_with_the_code_reward(tmp_path):
    """A few steps of `+experiment=code_cpu` through gspo-train (the sandbox in the trainer's
    reward scorer), then gspo-eval pass@k on its checkpoint."""
    run = tmp_path / "run"
    quiet = ["logging.progress=false", "logging.tensorboard=false"]
    gspo_train(run, "+experiment=code_cpu", "trainer.steps=4", "eval.every=2",
               "eval.heldout.problems=8", *quiet, timeout=900)  # fmt: skip
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        reasons = {k: v for k, v in record.items() if k.startswith("reward/code/")}
        assert sum(v for k, v in reasons.items() if k != "reward/code/cache_hits") == 128
        assert record["reward/failures"] == 0 and 0 <= record["reward/mean"] <= 1
    assert [r["step"] for r in records if "eval/pass@1" in r] == [2, 4]
    # gspo-eval on the checkpoint: the held-out prompts, and a code benchmark file scored
    # all-or-nothing by a reward of its own
    problems = tmp_path / "expr_problems.jsonl"
    rows = synthetic_records("expr", 6, split="eval", min_digits=2, max_digits=2)
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    benchmark = (f"+eval.benchmarks.code={{files: [{problems}], samples: 4, ks: [1, 4], "
                 "temperature: 1.0, reward: {name: code, kwargs: {scoring: all}}}")  # fmt: skip
    eval_dir = tmp_path / "eval"
    cmd = [sys.executable, "-m", "gspo_megatron.evaluate", f"hydra.run.dir={eval_dir}",
           "+experiment=code_cpu", f"model.init_from={run / 'checkpoints' / 'step_000004'}",
           "eval.heldout.problems=8", "eval.heldout.samples=4", "eval.heldout.temperature=1.0",
           "eval.heldout.ks=[1,4]", benchmark, *quiet]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((eval_dir / "summary.json").read_text())["benchmarks"]
    for name, count in (("heldout", 8), ("code", 6)):
        metrics = summary[name]["metrics"]
        assert set(metrics) >= {"pass@1", "pass@4", "reward_mean"}, metrics
        assert metrics["reward_failures"] == 0 and metrics["problems"] == count
        lines = (eval_dir / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == count and all(len(json.loads(x)["rewards"]) == 4 for x in lines)
    solved = [json.loads(x)["rewards"] for x in (eval_dir / "code.jsonl").read_text().splitlines()]
    assert {r for rewards in solved for r in rewards} <= {0.0, 1.0}  # all-or-nothing
