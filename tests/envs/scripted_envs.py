"""Environments for tests that need observations whatever the policy says (a random policy
never writes a tool call): importable as `envs.scripted_envs:Name` with tests/ on the path
(gspo-train test runs and workers have it)."""

from __future__ import annotations

from gspo_megatron.envs import Environment, StepResult


class TwoObservations(Environment):
    """Answers the first two turns with an observation (and 0.25 each) and ends the episode
    after the third; a turn holding "7" raises (the episode fails, counted)."""

    inline_safe = True

    def __init__(self) -> None:
        self.turns = 0

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        if "7" in turn:
            raise RuntimeError("seven")
        if self.turns == 3:
            return StepResult(done=True)
        return StepResult(observation="+:+" * self.turns, reward=0.25, tool_calls=1)
