"""One RL step's optimizer steps (docs/ARCHITECTURE.md §3, step 5): the batch shuffled and split
into algorithm.num_minibatches, each one optimizer step of PPO's critic (when there is one) and
then of the policy, and their metrics merged into one record.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from gspo_megatron.algorithms import explained_variance_from_sums
from gspo_megatron.metrics_schedule import EVERY_STEP, CostlyMetrics
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.sample import TrainSample


def run_optimizer_steps(
    samples: Sequence[TrainSample],
    policy,
    loss: LossSettings,
    *,
    num_minibatches: int,
    shuffle_seed: int,
    replay_routes: bool,
    critic=None,
    value_clip: float | None = None,
    critic_only: bool = False,
    metrics: CostlyMetrics = EVERY_STEP,
) -> dict[str, float]:
    """The optimizer steps' merged metrics (the critic's as critic/*). `policy` and `critic`:
    `train_step` / `train_value_step` and `current_lr` (TrainingEngine). `critic_only`: the
    critic's warm-up, the policy does not train. `metrics`: the costly metrics this step
    computes (metrics_schedule.py).

    A batch that dynamic sampling left smaller than planned is split into as many minibatches
    as it can feed (each needs one sequence per data-parallel rank); an empty one trains
    nothing.
    """
    order = list(range(len(samples)))
    random.Random(shuffle_seed).shuffle(order)
    count = min(num_minibatches, len(order) // policy.layout.dp)
    idle = {"optimizer_steps": 0.0, "skipped_steps": 0.0, "lr": policy.current_lr()}
    if count == 0:
        return idle
    bounds = [round(k * len(order) / count) for k in range(count + 1)]
    minibatches = [[samples[i] for i in order[bounds[k] : bounds[k + 1]]] for k in range(count)]
    critic_metrics = {}
    if critic is not None:
        per_step = [critic.train_value_step(m, clip=value_clip) for m in minibatches]
        for m in per_step:
            # of the values each update step starts from (the batch's old values: step_inputs)
            m["explained_variance_in_update"] = explained_variance_from_sums(m)
            for key in [k for k in m if k.startswith("ev_")]:
                del m[key]
        critic_metrics = {f"critic/{k}": v for k, v in merge_optimizer_steps(per_step).items()}
        if critic_only:
            return idle | critic_metrics
    per_step = [
        policy.train_step(
            m,
            loss,
            replay_routes=replay_routes,
            entropy_metric=metrics.entropy,
            route_metrics=metrics.routes,
        )
        for m in minibatches
    ]
    merged = merge_optimizer_steps(per_step)
    # Route changes after k updates since the old-policy forward (the paper's per-update view).
    for k, m in enumerate(per_step):
        if "moe/route_change_fraction" in m:
            merged[f"moe/route_change_fraction_after_{k}_updates"] = m["moe/route_change_fraction"]
    return merged | critic_metrics


def merge_optimizer_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """One RL step's optimizer steps as one record: means (extremes of *_max / *_min), the step
    and skip counts, the last learning rate, and grad_norm_max: the largest gradient norm (NaN
    when any was not finite: a skipped step)."""
    merged = {}
    keys = dict.fromkeys(k for m in per_step for k in m)  # a bucket may be in some steps only
    for key in keys:
        values = [m[key] for m in per_step if key in m]
        combine = max if key.endswith("_max") else min if key.endswith("_min") else np.mean
        merged[key] = float(combine(values))
    if "grad_norm" in merged:
        norms = np.array([m["grad_norm"] for m in per_step if "grad_norm" in m])
        merged["grad_norm_max"] = float(norms.max() if np.isfinite(norms).all() else np.nan)
    merged["optimizer_steps"] = float(len(per_step))
    merged["skipped_steps"] = float(sum(m.get("skipped", 0.0) for m in per_step))
    merged.pop("skipped", None)
    merged.pop("num_microbatches", None)
    merged["lr"] = per_step[-1]["lr"]
    return merged
