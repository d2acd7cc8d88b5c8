"""The GSPO family in pure PyTorch (no Megatron import): policy losses as per-item terms over a
global denominator, group advantages (per episode, or per turn of a multi-turn episode), KL
estimators, train/rollout mismatch corrections, DAPO / DUPO batch pieces, PPO's critic side
(GAE, value loss) and metrics. See docs/ALGORITHMS.md for the formulas and defaults."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    group_advantages,
    token_advantages,
    turn_advantages,
    turn_end_rewards,
    turn_returns,
    turn_token_advantages,
)
from .gae import (
    ValueLossTerms,
    explained_variance,
    explained_variance_from_sums,
    gae,
    masked_whiten,
    token_rewards,
    value_loss_terms,
)
from .kl import KL_ESTIMATORS, kl_estimate
from .losses import (
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    LossTerms,
    PolicyLossSpec,
    denominator_count,
    get_policy_loss,
    policy_loss,
    policy_loss_terms,
    sapo_gate,
    sum_loss_terms,
)
from .metrics import (
    clip_buckets,
    finalize_metrics,
    merge_metric_sums,
    metric_reduce_op,
    rollout_metrics,
)
from .mismatch import (
    MISMATCH_MODES,
    MismatchCorrection,
    correct_mismatch,
    mismatch_support,
    rollout_mismatch_sums,
)
from .sampling import (
    dapo_keep_indices,
    dupo_fill_indices,
    informative_groups,
    overlong_filter_mask,
    prefilter_solved_prompts,
    soft_overlong_penalty,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "MISMATCH_MODES",
    "POLICY_LOSSES",
    "LossTerms",
    "MismatchCorrection",
    "PolicyLossSpec",
    "ValueLossTerms",
    "clip_buckets",
    "correct_mismatch",
    "dapo_keep_indices",
    "denominator_count",
    "dupo_fill_indices",
    "explained_variance",
    "explained_variance_from_sums",
    "finalize_metrics",
    "gae",
    "get_policy_loss",
    "group_advantages",
    "informative_groups",
    "kl_estimate",
    "masked_whiten",
    "merge_metric_sums",
    "metric_reduce_op",
    "mismatch_support",
    "overlong_filter_mask",
    "policy_loss",
    "policy_loss_terms",
    "rollout_mismatch_sums",
    "prefilter_solved_prompts",
    "rollout_metrics",
    "sapo_gate",
    "soft_overlong_penalty",
    "sum_loss_terms",
    "token_advantages",
    "token_rewards",
    "value_loss_terms",
    "turn_advantages",
    "turn_end_rewards",
    "turn_returns",
    "turn_token_advantages",
]
