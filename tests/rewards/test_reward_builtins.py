"""Synthetic tasks (partial credit on hand-made examples), exact match, format, the registry."""

from __future__ import annotations

import random

import pytest

from gspo_megatron.rewards import (
    REWARDS,
    AddTask,
    CopyTask,
    ExactMatchReward,
    FormatReward,
    MathVerifyReward,
    RemoteReward,
    ReverseTask,
    RewardConfig,
    SortTask,
    SyntheticReward,
    build_reward,
    build_scorer,
    exact_solve,
    make_task,
    partial_credit,
)


@pytest.mark.parametrize(
    ("response", "target", "expected"),
    [
        ("4321", "4321", 1.0),  # exact
        ("4321 ", "4321", 4 / 5),  # a space instead of the end token: a generated token
        (" 4321", "4321", 0.0),  # whitespace is scored like any token: shifted by one
        ("4320", "4321", 3 / 4),  # one wrong position
        ("43", "4321", 2 / 4),  # too short: missing positions score 0
        ("432100", "4321", 4 / 6),  # too long: extra positions count against
        ("1234", "4321", 0.0),  # the copy instead of the reverse: no position matches
        ("", "4321", 0.0),
        ("x4321", "4321", 0.0),  # shifted by one: every position wrong
        ("0147", "0147", 1.0),
        ("842", "842", 1.0),
        ("84", "842", 2 / 3),
    ],
)
def test_partial_credit_hand_examples(response, target, expected):
    assert partial_credit(response, target) == pytest.approx(expected)
    assert SyntheticReward()("p", response, target) == pytest.approx(expected)
    assert SyntheticReward(partial=False)("p", response, target) == float(expected == 1.0)
    assert exact_solve(response, target) == (expected == 1.0)


def test_tasks_make_correct_instances_within_the_length_knob():
    rng = random.Random(0)
    for _ in range(200):
        p, t = CopyTask(min_digits=3, max_digits=5).sample(rng)
        digits = p.removeprefix("copy:").removesuffix("=")
        assert t == digits and 3 <= len(digits) <= 5 and digits.isdigit()
        p, t = ReverseTask(min_digits=2, max_digits=2).sample(rng)
        assert p.startswith("rev:") and t == p[4:6][::-1]
        p, t = SortTask().sample(rng)
        assert t == "".join(sorted(p[5:-1]))
        p, t = AddTask(min_digits=2, max_digits=3).sample(rng)
        a, b = p[:-1].split("+")
        assert int(t) == int(a) + int(b) and all(2 <= len(x) <= 3 for x in (a, b))
        assert not a.startswith("0") and not b.startswith("0")
    p, t = AddTask(min_digits=2, max_digits=2, reverse_answer=True).sample(rng)
    a, b = p[:-1].split("+")
    assert t[::-1] == str(int(a) + int(b))  # least significant digit first
    # hand examples
    assert ReverseTask().transform("4071") == "1704"
    assert SortTask().transform("4071") == "0147"


def test_task_errors():
    with pytest.raises(ValueError, match="min_digits"):
        CopyTask(min_digits=4, max_digits=2)
    with pytest.raises(ValueError, match="unknown synthetic task"):
        make_task("multiply")
    assert make_task("reverse", max_digits=3) == ReverseTask(max_digits=3)


def test_exact_match_and_format():
    em = ExactMatchReward()
    assert em("p", " Paris \n", "Paris") == 1.0
    assert em("p", "paris", "Paris") == 0.0
    assert ExactMatchReward(case_sensitive=False)("p", "paris", "Paris") == 1.0
    assert em("p", "b", ["a", "b"]) == 1.0  # a list of accepted answers
    assert ExactMatchReward(strip=False)("p", "a ", "a") == 0.0

    fmt = FormatReward()
    assert fmt("p", "so \\boxed{3}", None) == 1.0
    assert fmt("p", "so 3", None) == 0.0
    r1 = FormatReward(r"<think>.*?</think>\s*<answer>.*?</answer>", mode="fullmatch", reward=0.5)
    assert r1("p", "<think>a\nb</think>\n<answer>4</answer>", None) == 0.5
    assert r1("p", "<think>a</think> 4", None) == 0.0
    with pytest.raises(ValueError, match="not a valid regex"):
        FormatReward("(")


def test_registry_and_config():
    assert {"math", "exact_match", "format", "synthetic", "remote"} <= set(REWARDS)
    assert isinstance(build_reward("math", answer_format="boxed"), MathVerifyReward)
    assert isinstance(build_reward("remote", url="http://h:1/x"), RemoteReward)
    fn = build_reward("rewards.faulty_rewards:pid_reward")
    assert fn.__name__ == "pid_reward"
    assert isinstance(
        build_reward("gspo_megatron.rewards:SyntheticReward", partial=False), SyntheticReward
    )
    with pytest.raises(ValueError, match="unknown reward.name='nope'"):
        build_reward("nope")
    with pytest.raises(ValueError, match="reward.kwargs do not fit"):
        build_reward("synthetic", colour="red")
    with pytest.raises(ValueError, match="cannot import module"):
        build_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="reward.kwargs must be empty"):
        build_reward("rewards.faulty_rewards:pid_reward", a=1)
    with pytest.raises(ValueError, match="reward.executor"):
        RewardConfig(executor="gpu").validate()

    with build_scorer(RewardConfig(name="synthetic")) as scorer:
        batch = scorer.score(["rev:12="] * 2, ["21", "12"], ["21", "21"])
        assert batch.rewards == [1.0, 0.0] and batch.accuracy() == 0.5
