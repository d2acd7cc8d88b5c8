"""The stability monitor: the mismatch budget and the collapse sentinel over each step's metrics,
with their state for checkpoints (docs/STABILITY.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gspo_megatron.config import RunConfig
from gspo_megatron.notes import note
from gspo_megatron.stability.budget import BudgetAction, MismatchBudget
from gspo_megatron.stability.sentinel import CollapseSentinel, Firing


@dataclass
class Watch:
    """One step's verdict: stability/* metrics, a firing to act on (sentinel enabled), the
    mismatch budget's action."""

    metrics: dict[str, float]
    firing: Firing | None
    budget: BudgetAction | None


class StabilityMonitor:
    def __init__(self, cfg: RunConfig) -> None:
        self.enabled = cfg.stability.sentinel.enabled
        self.sentinel = CollapseSentinel(cfg.stability.sentinel)
        self.budget = MismatchBudget(cfg.stability.mismatch_budget, cfg.rollout.max_staleness)

    def observe(self, step: int, metrics: dict[str, float]) -> Watch:
        budget_metrics, action = self.budget.observe(step, metrics)
        if action is not None:
            note(action.message)
        out, firing = self.sentinel.observe(
            step, metrics, mismatch_over_budget=action.message if action else None
        )
        if firing is not None and not self.enabled:
            note(
                f"step {step}: the collapse sentinel would roll back here "
                f"(stability.sentinel.enabled=false): {firing.describe()}; signals since step "
                f"{firing.since}"
            )
            firing = None
        return Watch({**budget_metrics, **out}, firing, action)

    def health(self) -> dict[str, Any]:
        return self.sentinel.health()

    def state_dict(self) -> dict[str, Any]:
        return {"sentinel": self.sentinel.state_dict(), "budget": self.budget.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sentinel.load_state_dict(state.get("sentinel", {}))
        self.budget.load_state_dict(state.get("budget", {}))
