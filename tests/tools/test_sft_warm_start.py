"""tools/sft_warm_start.py: a supervised warm start on the calculator's demonstrations lowers
the model tokens' negative log-likelihood, and gspo-train starts from its checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys

from launch import REPO, gspo_train, gspo_train_env, read_metrics

from gspo_megatron.envs.calculator import CalculatorEnv, calculate
from gspo_megatron.envs.tools import parse_tool_calls


def test_calculator_demonstrations_are_well_formed():
    import random

    rng = random.Random(0)
    calls = 0
    for _ in range(200):
        turns = CalculatorEnv.demonstration("4679+5696=", "10375", rng)
        if len(turns) == 2:
            calls += 1
            (call,) = parse_tool_calls(turns[0])
            assert call.error is None and call.name == "calculator"
            expression = call.arguments["expression"]
            # each digit as the prompt's or one too high (the demonstrator's slip)
            for written, true in zip(expression.split("+"), ["4679", "5696"], strict=True):
                assert len(written) == 4
                assert all(int(w) in (int(t), (int(t) + 1) % 10)
                           for w, t in zip(written, true, strict=True))  # fmt: skip
            assert turns[1] == calculate(expression)
        else:
            assert len(turns[0]) == 5 and turns[0].isdigit()
    assert 70 < calls < 130


def test_warm_start_then_rl(tmp_path):
    out = tmp_path / "warm"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "sft_warm_start.py"), "--out", str(out),
         "--steps", "50", "+experiment=calculator_cpu", "rollout.prompts_per_step=16"],
        capture_output=True, text=True, timeout=600, env=gspo_train_env(), cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    nll = [float(x) for x in re.findall(r"nll per model token ([\d.]+)", proc.stdout)]
    assert len(nll) == 3 and nll[-1] < nll[0] / 2, nll
    gspo_train(
        tmp_path / "run", "+experiment=calculator_cpu", f"model.init_from={out}",
        "trainer.steps=2", "eval.every=0", "rollout.prompts_per_step=4",
        "logging.progress=false", "logging.tensorboard=false",
    )  # fmt: skip
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["env/tool_call_rate"] > 0 for r in records)  # the format was learned
