"""Rewards: the reward interface, a batched scorer with timeouts, and built-in rewards.

    from gspo_megatron.rewards import RewardConfig, build_scorer
    scorer = build_scorer(RewardConfig(name="synthetic"))
    batch = scorer.score(prompts, responses, labels)  # batch.rewards, batch.metrics()

See docs/REWARDS_AND_DATA.md.
"""

from gspo_megatron.rewards.base import RewardError, RewardFn, as_reward
from gspo_megatron.rewards.basic import ExactMatchReward, FormatReward
from gspo_megatron.rewards.math_reward import MathVerifyReward
from gspo_megatron.rewards.registry import (
    REWARDS,
    RewardConfig,
    build_reward,
    build_scorer,
    register_reward,
)
from gspo_megatron.rewards.scorer import RewardBatch, RewardScorer
from gspo_megatron.rewards.synthetic import (
    SYNTHETIC_TASKS,
    AddTask,
    CopyTask,
    ReverseTask,
    SortTask,
    SyntheticReward,
    SyntheticTask,
    exact_solve,
    make_task,
    partial_credit,
)


def __getattr__(name: str):
    if name in ("RemoteReward", "RemoteRewardError"):  # imports aiohttp only when used
        from gspo_megatron.rewards import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REWARDS",
    "SYNTHETIC_TASKS",
    "AddTask",
    "CopyTask",
    "ExactMatchReward",
    "FormatReward",
    "MathVerifyReward",
    "RemoteReward",
    "RemoteRewardError",
    "ReverseTask",
    "RewardBatch",
    "RewardConfig",
    "RewardError",
    "RewardFn",
    "RewardScorer",
    "SortTask",
    "SyntheticReward",
    "SyntheticTask",
    "as_reward",
    "build_reward",
    "build_scorer",
    "exact_solve",
    "make_task",
    "partial_credit",
    "register_reward",
]
