"""Environments by name (`env=calculator`, or `env.name=package.module:Class`), and the `env`
config section."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo_megatron.config_fields import bounded, choice, open_mapping, raise_on_problems
from gspo_megatron.envs.base import Environment
from gspo_megatron.envs.calculator import CalculatorEnv
from gspo_megatron.envs.retrieval import RetrievalEnv
from gspo_megatron.plugins import import_attr

ENVIRONMENTS: dict[str, type[Environment]] = {}
NO_ENVIRONMENT = "none"


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Decorator: register an Environment class under `name`."""

    def deco(cls: type[Environment]) -> type[Environment]:
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ValueError(
                f"environment {name!r} is already registered to {ENVIRONMENTS[name]!r}"
            )
        ENVIRONMENTS[name] = cls
        return cls

    return deco


register_environment("calculator")(CalculatorEnv)
register_environment("retrieval")(RetrievalEnv)


def environment_class(name: str) -> type[Environment]:
    """The class `env.name` names (registered, or "package.module:Class")."""
    if ":" in name:
        cls = import_attr(name, "env.name")
    elif name in ENVIRONMENTS:
        cls = ENVIRONMENTS[name]
    else:
        raise ValueError(
            f"unknown env.name={name!r}; choose one of {sorted(ENVIRONMENTS)}, "
            f"{NO_ENVIRONMENT!r} (single-turn rollouts) or give 'package.module:Class'"
        )
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"env.name={name!r} is not a subclass of gspo_megatron.envs.Environment")
    return cls


@dataclass
class EnvConfig:
    """The `env` config group: multi-turn rollouts (docs/ENVIRONMENTS.md).

    name: none (single-turn: one response per prompt), a registered environment (calculator,
    retrieval) or "package.module:Class". kwargs: the class's keyword arguments (one instance
    per episode). max_turns: model turns per episode. max_tokens: tokens after the initial
    context (model turns and observations); a turn or observation past it truncates the episode
    (finish reason "length"). timeout_s: limit of one reset or step call; executor: auto (inline
    for environments that declare inline_safe, else process) | inline (no timeout) | thread
    (each call in a daemon thread of its own, abandoned past the timeout) | process (`workers`
    worker processes, killed and replaced past the timeout; the environment travels pickled;
    gspo_megatron/envs/calls.py). A raising or hanging call ends its episode with reward 0,
    counted in env/failures and env/timeouts.
    on_tool_error: observe (a malformed or failing tool call gets an "error: ..." observation) |
    end (it ends the episode with reward 0). max_concurrent_turns: model turns in flight at once
    from one batch of episodes on an engine outside the trainer (SGLang's concurrent requests;
    the generator process's jobs), episodes going at their own pace (rollout/episodes.py); the
    embedded engine in the trainer batches every due turn (split by rollout.max_batch_tokens).
    """

    name: str = NO_ENVIRONMENT
    kwargs: dict[str, Any] = open_mapping()
    max_turns: int = bounded(4, ge=1)
    max_tokens: int = bounded(256, ge=1)
    timeout_s: float = bounded(10.0, gt=0)
    executor: str = choice("auto", "inline", "thread", "process")
    workers: int = bounded(4, ge=1)
    on_tool_error: str = choice("observe", "end")
    max_concurrent_turns: int = bounded(256, ge=1, le=65536)

    @property
    def enabled(self) -> bool:
        return self.name != NO_ENVIRONMENT

    def validate(self) -> None:
        raise_on_problems(self, "env")
        if not self.enabled:
            return
        cls = environment_class(self.name)
        try:
            inspect.signature(cls).bind(**dict(self.kwargs))
        except TypeError as e:
            raise ValueError(f"env.kwargs do not fit environment {self.name!r}: {e}") from None
