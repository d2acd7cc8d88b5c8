"""Synthetic task data sets: deterministic from the seed, disjoint train / held-out splits."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.data import (
    DataConfig,
    DataError,
    build_char_tokenizer,
    build_datasets,
    in_heldout,
    synthetic_prompt_dataset,
    synthetic_records,
)
from gspo_megatron.data.synthetic import main
from gspo_megatron.rewards import SYNTHETIC_TASKS, SyntheticReward, make_task
from gspo_megatron.rewards.code import parse_problem
from gspo_megatron.rewards.synthetic import CODE_TASKS


@pytest.mark.parametrize("name", sorted(SYNTHETIC_TASKS))
def test_deterministic_and_disjoint(name):
    a = synthetic_records(name, 300, seed=5, split="train")
    assert a == synthetic_records(name, 300, seed=5, split="train")
    assert a != synthetic_records(name, 300, seed=6, split="train")
    held = synthetic_records(name, 100, seed=5, split="eval")
    other_seed = synthetic_records(name, 300, seed=6, split="train")
    train_prompts = {r["prompt"] for r in a} | {r["prompt"] for r in other_seed}
    assert train_prompts.isdisjoint(r["prompt"] for r in held)
    task = make_task(name)
    assert all(in_heldout(task, r["prompt"], 0.1) for r in held)
    if name in CODE_TASKS:  # a code problem: its expected output is the prompt's sum
        for r in a + held:
            problem = parse_problem(r["label"])
            numbers = map(int, r["prompt"].rstrip("=").split("+"))
            assert (problem.mode, problem.tests[0].output) == ("expression", f"{sum(numbers)}\n")
        return
    reward = SyntheticReward()
    assert all(reward(r["prompt"], r["label"], r["label"]) == 1.0 for r in a + held)


def test_size_knob_and_tiny_spaces():
    recs = synthetic_records("copy", 50, min_digits=3, max_digits=3)
    assert all(len(r["label"]) == 3 for r in recs)
    # 1-digit addition has 100 instances; ~10% are held out, so an eval set repeats them
    evals = synthetic_records("add", 40, split="eval", max_digits=1)
    assert 1 < len({r["prompt"] for r in evals}) < 40
    with pytest.raises(DataError, match="instance space is too small"):
        synthetic_records(
            "copy", 5, split="eval", min_digits=1, max_digits=1, heldout_fraction=0.01
        )
    with pytest.raises(DataError, match="heldout_fraction"):
        synthetic_records("copy", 5, heldout_fraction=1.0)


def test_prompt_dataset_and_config():
    tok = build_char_tokenizer()
    ds = synthetic_prompt_dataset(tok, "reverse", 20, seed=1, max_digits=4)
    first = synthetic_records("reverse", 20, seed=1, max_digits=4)[0]
    assert ds[0].prompt == first["prompt"] and ds[0].label == first["label"]
    assert ds[0].prompt_ids == tok(first["prompt"]).input_ids
    cfg = DataConfig(task="sort", task_kwargs={"max_digits": 5}, num_train=64, num_eval=16)
    train, evals = build_datasets(cfg, tok)
    assert len(train) == 64 and len(evals) == 16
    assert {p.prompt for p in train}.isdisjoint(p.prompt for p in evals)
    assert build_datasets(DataConfig(task="copy", num_train=4, num_eval=0), tok)[1] is None


def test_command_line(tmp_path, capsys):
    out = tmp_path / "add.jsonl"
    main(["--task", "add", "--num", "7", "--max-digits", "2", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == synthetic_records("add", 7, max_digits=2)
    assert "wrote 7 add train records" in capsys.readouterr().out
