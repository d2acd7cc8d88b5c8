"""Math verification on real-looking answers (expected values worked out by hand)."""

from __future__ import annotations

import pytest

from gspo_megatron.rewards import MathVerifyReward, RewardScorer

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        # boxed answers, equal values in different notations
        ("So the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
        ("Therefore $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("\\boxed{\\dfrac12}", "$\\frac{1}{2}$", 1.0),
        ("The final answer is $\\boxed{2^{1/2}}$.", "\\sqrt{2}", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("We get \\boxed{\\frac{6}{4}}", "\\frac{3}{2}", 1.0),
        ("\\boxed{10}", "10\\%", 1.0),
        # wrong answers
        ("\\boxed{1/3}", "\\frac{1}{2}", 0.0),
        ("The final answer is $\\boxed{-3}$.", "3", 0.0),
        ("\\boxed{3.14}", "\\pi", 0.0),
        ("I am not sure.", "\\frac{1}{2}", 0.0),
        ("", "7", 0.0),
        # GSM8K: the gold is a full solution ending in "#### 72"
        ("48/2 = 24, 48 + 24 = 72\n#### 72", GSM8K_GOLD, 1.0),
        ("48 + 24 = 73\n#### 73", GSM8K_GOLD, 0.0),
        ("#### 1,000", "1000", 1.0),
        # DAPO-Math style
        ("Let me compute 3*14 = 42.\nAnswer: 42", "42", 1.0),
        ("Answer: 41", "42", 0.0),
    ],
)
def test_auto_format(response, gold, expected):
    assert MathVerifyReward()("question", response, gold) == expected


def test_strict_formats_read_only_their_marker():
    gsm8k = MathVerifyReward(answer_format="gsm8k")
    assert gsm8k("q", "I think 5, no: 7\n#### 7", "7") == 1.0
    assert gsm8k("q", "The answer is \\boxed{7}", "7") == 0.0  # no "####"
    assert gsm8k("q", "#### 1,234", "1234") == 1.0

    dapo = MathVerifyReward(answer_format="dapo")
    assert dapo("q", "so 12 + 30.\nAnswer: $\\frac{84}{2}$", "42") == 1.0
    assert dapo("q", "Answer: 40\nwait, Answer: 42", "42") == 1.0  # last marker wins
    assert dapo("q", "\\boxed{42}", "42") == 0.0

    boxed = MathVerifyReward(answer_format="boxed")
    assert boxed("q", "x = 42", "42") == 0.0
    assert boxed("q", "x = \\boxed{42}", "42") == 1.0


def test_bad_config_and_unparseable_gold():
    with pytest.raises(ValueError, match="answer_format"):
        MathVerifyReward(answer_format="latex")
    with pytest.raises(ValueError, match="gold answer"):
        MathVerifyReward()("q", "\\boxed{1}", "")


def test_in_worker_processes_through_the_scorer():
    responses = ["\\boxed{\\frac{1}{2}}", "#### 72", "no idea", "\\boxed{0.25}"]
    labels = ["0.5", GSM8K_GOLD, "3", "1/4"]
    with RewardScorer(MathVerifyReward(), timeout_s=20, max_concurrency=1) as scorer:
        assert scorer.executor == "process"
        batch = scorer.score(["q"] * 4, responses, labels)
    assert batch.rewards == [1.0, 1.0, 0.0, 1.0]
    assert batch.status == ["ok"] * 4
