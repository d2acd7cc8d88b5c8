"""The collapse sentinel (docs/STABILITY.md, "The collapse sentinel"): signals read from each
step's metrics, each against a moving average of the run's healthy steps; when one persists for
its patience, the sentinel fires, and the trainer rolls back to the newest healthy checkpoint
(stability/rollback.py).

A signal's streak starts at the first step it is seen; baselines (exponential moving averages
with weight 1/window) move only on steps with no signal, so a collapse never becomes the normal
it is measured against. After a firing the sentinel holds until a step with no signal: a
collapse that persists fires once (what matters with the sentinel off; on, the rollback
replaces the state). The state (baselines, streaks, the hold) is saved with every checkpoint,
so a resumed or rolled-back run watches exactly as the uninterrupted one did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gspo_megatron.config import SentinelSection

SIGNALS = ("nonfinite", "reward", "entropy", "grad_norm", "mismatch")
# metric -> the baseline it feeds
_BASELINES = {
    "reward": "reward/mean",
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm_max",
}
_FINITE_CHECKED = ("reward/mean", "actor/loss", "actor/entropy", "actor/grad_norm_max")
# a step's advantages, whichever the estimator reports (group baselines / GAE)
_ADVANTAGE_SIZES = ("advantage/abs_mean", "advantage/token_abs_mean")


@dataclass
class Firing:
    """The sentinel fired at `step`: the signals that reached their patience (name -> what was
    seen, with the numbers) and `since`, the first step of the earliest streak still running."""

    step: int
    since: int
    signals: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.signals.items())


class CollapseSentinel:
    def __init__(self, settings: SentinelSection) -> None:
        self.settings = settings
        self.baselines: dict[str, float] = {}
        # name -> [steps in a row, first step, what the latest step saw]
        self.streaks: dict[str, list] = {}
        self.holding = False  # fired, and no step without a signal since

    # -- per step -----------------------------------------------------------------------------

    def observe(
        self, step: int, metrics: dict[str, float], *, mismatch_over_budget: str | None = None
    ) -> tuple[dict[str, float], Firing | None]:
        """Update with step `step`'s metrics: (stability/* metrics, a Firing or None).
        `mismatch_over_budget`: what the mismatch budget saw when it was exceeded this step."""
        seen = self._signals(step, metrics, mismatch_over_budget)
        for name in SIGNALS:
            if name not in seen:
                self.streaks.pop(name, None)
                continue
            count, since, _ = self.streaks.get(name, [0, step, ""])
            self.streaks[name] = [count + 1, since, seen[name]]
        if not self.streaks:
            self._update_baselines(metrics)
            self.holding = False
        out = {f"stability/{name}_ema": v for name, v in self.baselines.items()}
        out["stability/signals_active"] = float(len(self.streaks))
        fired = {
            name: why
            for name, (count, _, why) in self.streaks.items()
            if count >= self._patience(name)
        }
        if not fired or self.holding:
            return out, None
        self.holding = True
        out["stability/sentinel_fired"] = 1.0
        return out, Firing(step, min(since for _, since, _ in self.streaks.values()), fired)

    def health(self) -> dict[str, Any]:
        """What a checkpoint saved now records: healthy when no signal is running."""
        if not self.streaks:
            return {"healthy": True}
        return {
            "healthy": False,
            "suspect_since": min(since for _, since, _ in self.streaks.values()),
            "signals": {name: why for name, (_, _, why) in self.streaks.items()},
        }

    # -- signals --------------------------------------------------------------------------------

    def _patience(self, name: str) -> int:
        s = self.settings
        return {
            "nonfinite": s.nonfinite_patience,
            "reward": s.reward_patience,
            "entropy": s.entropy_patience,
            "grad_norm": s.grad_norm_patience,
            "mismatch": 1,
        }[name]

    def _signals(
        self, step: int, metrics: dict[str, float], mismatch_over_budget: str | None
    ) -> dict[str, str]:
        """name -> what was seen, for every signal present at this step."""
        s, seen = self.settings, {}
        if s.nonfinite_patience and (why := _nonfinite(metrics)):
            seen["nonfinite"] = why
        if s.on_mismatch_budget and mismatch_over_budget:
            seen["mismatch"] = mismatch_over_budget
        if step <= s.warmup_steps:
            return seen
        reward = self._against_baseline("reward", metrics)
        if s.reward_drop and reward and reward[0] < reward[1] - s.reward_drop:
            value, base = reward
            seen["reward"] = (
                f"reward/mean {value:.4g} is {base - value:.4g} below its moving average "
                f"{base:.4g} (stability.sentinel.reward_drop={s.reward_drop:g})"
            )
        entropy = self._against_baseline("entropy", metrics)
        if (
            s.entropy_fraction
            and entropy
            and entropy[1] >= s.entropy_floor
            and entropy[0] < s.entropy_fraction * entropy[1]
        ):
            value, base = entropy
            seen["entropy"] = (
                f"actor/entropy {value:.4g} is {value / base:.3g} of its moving average "
                f"{base:.4g} (stability.sentinel.entropy_fraction={s.entropy_fraction:g})"
            )
        grad = self._against_baseline("grad_norm", metrics)
        dip = reward is not None and reward[0] < reward[1]
        if (
            s.grad_norm_factor
            and grad
            and grad[1] > 0
            and grad[0] > s.grad_norm_factor * grad[1]
            and (dip or not s.grad_norm_requires_reward_dip)
        ):
            value, base = grad
            seen["grad_norm"] = (
                f"actor/grad_norm_max {value:.4g} is {value / base:.3g}x its moving average "
                f"{base:.4g} (stability.sentinel.grad_norm_factor={s.grad_norm_factor:g})"
            )
            if dip:
                seen["grad_norm"] += (
                    f" while reward/mean {reward[0]:.4g} is below its moving average "
                    f"{reward[1]:.4g}"
                )
        return seen

    def _against_baseline(self, name: str, metrics: dict[str, float]) -> tuple[float, float] | None:
        """(this step's value, its baseline), when both are there and finite."""
        value = metrics.get(_BASELINES[name])
        if value is None or not math.isfinite(value) or name not in self.baselines:
            return None
        return float(value), self.baselines[name]

    def _update_baselines(self, metrics: dict[str, float]) -> None:
        weight = 1.0 / self.settings.window
        for name, key in _BASELINES.items():
            value = metrics.get(key)
            if value is None or not math.isfinite(value):
                continue
            if name == "grad_norm" and _no_advantage(metrics):
                # Every group solved (or failed) alike: the gradient is zero by construction,
                # not a small one. Counting those steps drags the baseline towards zero as a
                # run converges, and the next step with one failed sample looks like a spike.
                continue
            old = self.baselines.get(name)
            self.baselines[name] = value if old is None else old + weight * (value - old)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "baselines": dict(self.baselines),
            "streaks": {k: list(v) for k, v in self.streaks.items()},
            "holding": self.holding,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baselines = {k: float(v) for k, v in state.get("baselines", {}).items()}
        self.streaks = {k: list(v) for k, v in state.get("streaks", {}).items()}
        self.holding = bool(state.get("holding", False))


def _no_advantage(metrics: dict[str, float]) -> bool:
    """Whether the step's advantages were all zero (no policy gradient to measure)."""
    return any(metrics.get(key) == 0.0 for key in _ADVANTAGE_SIZES)


def _nonfinite(metrics: dict[str, float]) -> str | None:
    """What was non-finite in a step's metrics (skipped optimizer steps included), or None."""
    bad = [k for k in _FINITE_CHECKED if k in metrics and not math.isfinite(metrics[k])]
    skipped = metrics.get("actor/skipped_steps", 0.0)
    if skipped:
        bad.append(
            f"{skipped:g} of {metrics.get('actor/optimizer_steps', 0.0):g} optimizer steps "
            "skipped for a non-finite loss or gradient"
        )
    return ", ".join(f"non-finite {b}" if "/" in b and " " not in b else b for b in bad) or None
