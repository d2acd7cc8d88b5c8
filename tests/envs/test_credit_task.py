"""The two-turn tasks of docs/ENVIRONMENTS.md's per-turn credit comparison score each turn."""

from __future__ import annotations

import pytest
from envs.credit_task import NoScore, TwoAnswers


@pytest.mark.parametrize(("second", "final"), [("copy", 0.0), ("reverse", 1.0)])
def test_each_turn_is_scored(second, final):
    env = TwoAnswers(second=second)
    assert env.reset("copy:123=", "123") is None
    first = env.step("123")
    assert (first.reward, first.done, first.observation, first.role) == (1.0, False, "=", "user")
    last = env.step("321")
    assert last.done and last.reward == final  # copy: the reward section scores the answer
    assert NoScore()("p", "r", "l") == 0.0
    with pytest.raises(ValueError, match="second must be"):
        TwoAnswers(second="sort")
