"""Which of the metrics that cost work beyond the step's own a step computes
(logging.costly_metrics_every; docs/STABILITY.md, "Metrics every N steps").

Costly metrics: the policy's entropy on the trained tokens (a pass over the vocabulary in the
old-policy forward, or in every training forward without one), the MoE route metrics (routes
recorded in the old-policy forward, expert load, route flips against the rollout's experts, the
training forwards' route-change counts and their reduction over ranks) and the train/rollout
mismatch metrics. Each is computed on the
steps that are multiples of the interval and on the run's last step, and on every step when a
stability check reads it, so the collapse sentinel and the mismatch budget see what they watch
at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gspo_megatron.config import RunConfig


@dataclass(frozen=True)
class CostlyMetrics:
    """What one step computes: actor/entropy (with engine.entropy_metric), the MoE route metrics
    (with logging.moe_route_metrics where it applies), the mismatch/* metrics."""

    entropy: bool = True
    routes: bool = True
    mismatch: bool = True


EVERY_STEP = CostlyMetrics()


class CostlyMetricsSchedule:
    def __init__(self, cfg: RunConfig) -> None:
        self.every = cfg.logging.costly_metrics_every
        self.last_step = cfg.trainer.steps
        budget = cfg.stability.mismatch_budget
        # read at every step by the sentinel (even disabled, it logs what it would do) and the
        # mismatch budget
        self.always = CostlyMetrics(
            entropy=cfg.stability.sentinel.entropy_fraction > 0,
            routes=budget.route_flips > 0,
            mismatch=budget.k3_kl > 0,
        )

    def at(self, step: int) -> CostlyMetrics:
        """What step `step` (1-based: the step the loop is about to run) computes."""
        if step % self.every == 0 or step >= self.last_step:
            return EVERY_STEP
        return self.always
