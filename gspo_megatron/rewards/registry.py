"""Rewards by name, for config selection (`reward.name=math reward.kwargs.answer_format=boxed`).

`build_reward(name, **kwargs)` accepts a registered name or "package.module:attribute" for a
user's own reward; an attribute that is a class is instantiated with kwargs, a plain function
is returned as is (kwargs must then be empty).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gspo_megatron.config_fields import bounded, choice, raise_on_problems
from gspo_megatron.plugins import import_attr
from gspo_megatron.rewards.base import RewardFn
from gspo_megatron.rewards.basic import ExactMatchReward, FormatReward
from gspo_megatron.rewards.math_reward import MathVerifyReward
from gspo_megatron.rewards.scorer import EXECUTORS, RewardScorer
from gspo_megatron.rewards.synthetic import SyntheticReward

REWARDS: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: register a reward factory (a class or a function returning a reward)."""

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in REWARDS and REWARDS[name] is not factory:
            raise ValueError(f"reward {name!r} is already registered to {REWARDS[name]!r}")
        REWARDS[name] = factory
        return factory

    return deco


def _code(**kwargs: Any) -> RewardFn:
    from gspo_megatron.rewards.code import CodeReward  # the sandbox only when used

    return CodeReward(**kwargs)


def _remote(**kwargs: Any) -> RewardFn:
    from gspo_megatron.rewards.remote import RemoteReward  # aiohttp only when used

    return RemoteReward(**kwargs)


register_reward("math")(MathVerifyReward)
register_reward("exact_match")(ExactMatchReward)
register_reward("format")(FormatReward)
register_reward("synthetic")(SyntheticReward)
register_reward("remote")(_remote)
register_reward("code")(_code)


def build_reward(name: str, **kwargs: Any) -> RewardFn:
    """The reward function for `name` (registered, or "module:attribute")."""
    if ":" in name:
        target = import_attr(name, "reward.name")
        if inspect.isclass(target):
            return target(**kwargs)
        if kwargs:
            raise ValueError(
                f"reward.name={name!r} is a function; reward.kwargs must be empty, got "
                f"{sorted(kwargs)}"
            )
        return target
    if name not in REWARDS:
        raise ValueError(
            f"unknown reward.name={name!r}; choose one of {sorted(REWARDS)} or give "
            "'package.module:function'"
        )
    try:
        return REWARDS[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"reward.kwargs do not fit reward {name!r}: {exc}") from None


@dataclass
class RewardConfig:
    """The `reward` config group.

    name: registered reward (math, exact_match, format, synthetic, remote, code) or
    "module:function".
    kwargs: arguments of that reward (e.g. answer_format for math, url for remote).
    timeout_s: limit for one reward call; a call past it gives 0 and counts as a timeout.
    max_concurrency: calls in flight at once (= worker processes for the process executor).
    executor: auto | inline | thread | process (see gspo_megatron.rewards.scorer).
    max_failure_fraction / max_failing_steps: the run stops (after a checkpoint) when more than
    this fraction of reward calls failed or timed out in each of that many consecutive steps;
    max_failure_fraction=1 never stops.
    model_path: a learned reward model (a Hugging Face *ForSequenceClassification directory
    with one label, or a gspo-megatron checkpoint of one), scored on the trainer's ranks; the
    reward is then rule_weight x the rule reward above + model_weight x the model's score.
    Evaluation reports the rule reward.
    """

    name: str = "synthetic"
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = bounded(10.0, gt=0)
    max_concurrency: int = bounded(4, ge=1)
    executor: str = choice(*EXECUTORS)
    max_failure_fraction: float = bounded(0.5, ge=0, le=1)
    max_failing_steps: int = bounded(10, ge=1)
    model_path: str | None = None
    model_weight: float = 1.0
    rule_weight: float = bounded(1.0, ge=0)

    def validate(self) -> None:
        raise_on_problems(self, "reward")
        if self.model_path is None:
            for key in ("model_weight", "rule_weight"):
                if getattr(self, key) != 1.0:
                    raise ValueError(
                        f"reward.{key} is set but there is no reward model to weigh against "
                        "the rule reward: set reward.model_path"
                    )
        if ":" not in self.name and self.name not in REWARDS:
            raise ValueError(
                f"unknown reward.name={self.name!r}; choose one of {sorted(REWARDS)} or give "
                "'package.module:function'"
            )
        if ":" in self.name:
            import_attr(
                self.name, "reward.name"
            )  # a user function that cannot be imported fails here


def build_scorer(cfg: RewardConfig) -> RewardScorer:
    """The scorer for a reward config (call `close()` on it when done)."""
    cfg.validate()
    kwargs: Any = cfg.kwargs
    if not isinstance(kwargs, dict):  # an OmegaConf DictConfig
        from omegaconf import OmegaConf

        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    fn = build_reward(cfg.name, **kwargs)
    return RewardScorer(
        fn,
        timeout_s=cfg.timeout_s,
        max_concurrency=cfg.max_concurrency,
        executor=cfg.executor,  # type: ignore[arg-type]
    )
