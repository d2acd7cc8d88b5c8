"""The mismatch budget (docs/STABILITY.md, "The mismatch budget"): the rollout/trainer mismatch
(mismatch/k3_kl, moe/route_flips) averaged over a window of steps against
stability.mismatch_budget, and the configured remedy when it is exceeded. The trainer applies
the remedy (the Trainer); this module decides it, says why in one line with the numbers, and
keeps what it changed (MIS on, the staleness bound) in its state, saved with every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gspo_megatron.config import MismatchBudgetSection

# budgeted setting -> the metric it bounds
_BUDGETED = {"k3_kl": "mismatch/k3_kl", "route_flips": "moe/route_flips"}


@dataclass
class BudgetAction:
    """What to do now: `remedy` (warn | mis | lower_staleness | stop) and the line saying why."""

    remedy: str
    message: str


class MismatchBudget:
    def __init__(self, settings: MismatchBudgetSection, max_staleness: int) -> None:
        self.settings = settings
        self.windows: dict[str, list[float]] = {name: [] for name in _BUDGETED}
        self.mis_on = False
        self.max_staleness = max_staleness
        self.actions = 0

    @property
    def active(self) -> bool:
        return bool(self.settings.k3_kl or self.settings.route_flips)

    def observe(
        self, step: int, metrics: dict[str, float]
    ) -> tuple[dict[str, float], BudgetAction | None]:
        """Update the windows with step `step`'s metrics: (stability/* metrics, an action or
        None)."""
        if not self.active:
            return {}, None
        s, out, over = self.settings, {}, []
        for name, key in _BUDGETED.items():
            limit = getattr(s, name)
            value = metrics.get(key)
            if not limit or value is None or not math.isfinite(value):
                continue
            window = self.windows[name]
            window.append(float(value))
            del window[: -s.window]
            mean = sum(window) / len(window)
            out[f"stability/{name}_window_mean"] = mean
            if len(window) == s.window and mean > limit:
                over.append(
                    f"{key} averaged {mean:.4g} over the last {s.window} steps, above "
                    f"stability.mismatch_budget.{name}={limit:g}"
                )
        action = self._act(step, over) if over else None
        out["stability/mismatch_over_budget"] = float(bool(over))
        out["stability/mismatch_actions"] = float(self.actions)
        if s.remedy == "mis":
            out["stability/mis_on"] = float(self.mis_on)
        if s.remedy == "lower_staleness":
            out["stability/max_staleness"] = float(self.max_staleness)
        return out, action

    def _act(self, step: int, over: list[str]) -> BudgetAction:
        why = f"step {step}: mismatch budget exceeded: {'; '.join(over)}"
        for window in self.windows.values():
            window.clear()
        remedy = self.settings.remedy
        if remedy == "mis" and not self.mis_on:
            self.mis_on = True
            done = "remedy mis: algorithm.mismatch=mis turned on from the next step"
        elif remedy == "lower_staleness" and self.max_staleness > 1:
            self.max_staleness -= 1
            done = f"remedy lower_staleness: rollout.max_staleness lowered to {self.max_staleness}"
        elif remedy == "stop":
            done = "remedy stop: a checkpoint, then the run stops"
        else:
            done = {
                "warn": "remedy warn",
                "mis": "remedy mis: MIS is on already, nothing more to change",
                "lower_staleness": "remedy lower_staleness: rollout.max_staleness is 1 already, "
                "nothing more to lower",
            }[remedy]
            remedy = "warn"
        self.actions += 1
        return BudgetAction(remedy, f"{why}; {done}")

    def state_dict(self) -> dict[str, Any]:
        return {
            "windows": {k: list(v) for k, v in self.windows.items()},
            "mis_on": self.mis_on,
            "max_staleness": self.max_staleness,
            "actions": self.actions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows = {k: list(state.get("windows", {}).get(k, [])) for k in _BUDGETED}
        self.mis_on = bool(state.get("mis_on", False))
        self.max_staleness = int(state.get("max_staleness", self.max_staleness))
        self.actions = int(state.get("actions", 0))
