"""Two-turn tasks for per-turn credit (docs/ENVIRONMENTS.md, "Per-turn credit"): importable as
`envs.credit_task:TwoAnswers` with tests/ on the path.

The synthetic `copy` task's prompt, answered twice. The environment scores the first turn
(partial credit per digit against the label) and asks again. second="copy": the reward section
scores the second turn, the final answer, the same way (the same skill twice). second="reverse"
(with reward.name=envs.credit_task:NoScore): the environment scores the second turn against the
reversed label (two different skills). An episode's reward is the sum of the two. With per-turn
credit (turn_gamma 0) each turn is credited with its own score only; with the episode sum both
turns share it, so each turn's advantage carries the other turn's noise.
"""

from __future__ import annotations

from gspo_megatron.envs import Environment, StepResult
from gspo_megatron.rewards.synthetic import partial_credit


class TwoAnswers(Environment):
    inline_safe = True

    def __init__(self, again: str = "=", second: str = "copy") -> None:
        if second not in ("copy", "reverse"):
            raise ValueError(f"second must be copy or reverse, got {second!r}")
        self.again, self.second = again, second
        self.label = ""
        self.turns = 0

    def reset(self, prompt: str, label=None):
        self.label, self.turns = str(label), 0
        return None  # the data set's prompt ids

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult(
                observation=self.again, reward=partial_credit(turn, self.label), role="user"
            )
        if self.second == "reverse":
            return StepResult(done=True, reward=partial_credit(turn, self.label[::-1]))
        return StepResult(done=True)  # the reward section scores the final answer


class NoScore:
    """A reward section that scores nothing (the environment scores every turn)."""

    inline_safe = True

    def __call__(self, prompt: str, response: str, label) -> float:
        return 0.0
