"""What an environment of multi-turn rollouts is: one object per episode, reset once, then
stepped with each model turn until it says the episode is done.

    class Echo(Environment):
        def step(self, turn: str) -> StepResult:
            if "bye" in turn:
                return StepResult(done=True, reward=1.0)
            return StepResult(observation=f"you said {turn}")

An observation is text (one message, or a list of messages, of `StepResult.role`, rendered by
the tokenizer's chat template: the episode runner appends exactly the tokens the template adds
after the model's turn, ending with the prompt of the next model turn) or token ids appended as
they are. The runner (gspo_megatron/rollout/episodes.py) keeps the trajectory as token ids and
never re-tokenises what is already in it.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

Observation = str | Sequence[str] | Sequence[int] | None


class EnvironmentContractError(TypeError):
    """An environment returned something outside its contract (a bug in the environment, not a
    failing episode): the run stops naming the class."""


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn.

    observation: appended before the next model turn (None: nothing; the episode must be done).
    reward: this turn's reward, summed into the episode's (on top of the reward section's score
    of the final answer). done: the episode ends after this turn. tool_calls / tool_errors:
    counted in the `env/` metrics (tool calls made; calls that could not run: unknown tool,
    bad JSON, missing or unexpected argument, a tool that raised).
    """

    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    role: str = "tool"
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(ABC):
    """One episode. A new instance is built for every episode (`env.kwargs` are its keyword
    arguments), so an episode's state lives on `self`.

    `inline_safe = True` declares that reset and step are bounded pure-Python work that may run
    in the trainer's thread (env.executor=auto); otherwise each call runs in a thread of its
    own under `env.timeout_s`.
    """

    inline_safe: ClassVar[bool] = False

    def reset(self, prompt: str, label: Any = None) -> Observation:
        """The episode's initial context. None: the data set's prompt ids as they are; text: a
        user message rendered by the chat template with the prompt of the first model turn;
        token ids: as they are."""
        return None

    @abstractmethod
    def step(self, turn: str) -> StepResult:
        """The model's turn (its text, without the final stop token) -> what follows."""

    @classmethod
    def demonstration(cls, prompt: str, label: Any, rng: random.Random) -> list[str] | None:
        """Model turns of one demonstration episode, for a supervised warm start before RL
        (tools/sft_warm_start.py); None: this environment has none."""
        return None


def check_observation(observation: Any, where: str, messages: bool = True) -> None:
    """Raise EnvironmentContractError naming `where` unless `observation` is text, token ids,
    None, or (with `messages`) a list of texts."""
    if observation is None or isinstance(observation, str):
        return
    if isinstance(observation, Sequence) and not isinstance(observation, bytes | bytearray):
        items = list(observation)
        if messages and items and all(isinstance(x, str) for x in items):
            return
        if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
            return
    kinds = "a string, a list of strings (messages), " if messages else "a string, "
    raise EnvironmentContractError(
        f"{where} returned {type(observation).__name__} {_clip(observation)}: it must return "
        f"{kinds}a list of non-negative token ids, or None"
    )


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_step_result(result: Any, where: str) -> StepResult:
    if not isinstance(result, StepResult):
        raise EnvironmentContractError(
            f"{where} returned {type(result).__name__}; step() must return a StepResult"
        )
    check_observation(result.observation, where)
    if result.observation is None and not result.done:
        raise EnvironmentContractError(
            f"{where} returned no observation for an episode that is not done: return an "
            "observation, or done=True"
        )
    try:
        float(result.reward)
    except (TypeError, ValueError):
        raise EnvironmentContractError(
            f"{where} returned reward {result.reward!r}; a reward must be a number"
        ) from None
    return result
