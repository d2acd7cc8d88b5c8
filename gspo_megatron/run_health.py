"""Stop a run that keeps going without learning, loudly: optimizer steps skipped for non-finite
values many times in a row, or a reward function that fails on most calls step after step.

Both would otherwise run to the end and exit 0 (every step skipped; every reward 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.config import RunConfig


class RunHealthError(RuntimeError):
    """The run cannot make progress; the message says why and which setting governs it."""


@dataclass
class HealthVerdict:
    error: RunHealthError
    checkpoint_first: bool  # the weights are sound: save them so the run can resume once fixed


class RunHealth:
    def __init__(self, cfg: RunConfig) -> None:
        self.max_skipped = cfg.trainer.max_consecutive_skipped_steps
        self.max_failure_fraction = cfg.reward.max_failure_fraction
        self.max_failing_steps = cfg.reward.max_failing_steps
        self.reward_name = cfg.reward.name
        self.skipped_in_a_row = 0
        self.failing_steps_in_a_row = 0

    def check(self, metrics: dict[str, float]) -> HealthVerdict | None:
        """Update the streaks with one RL step's metrics; a verdict when the run must stop."""
        attempted = int(metrics.get("actor/optimizer_steps", 0))
        skipped = int(metrics.get("actor/skipped_steps", 0))
        if attempted:
            self.skipped_in_a_row = self.skipped_in_a_row + skipped if skipped == attempted else 0
        if self.skipped_in_a_row >= self.max_skipped:
            return HealthVerdict(
                RunHealthError(
                    f"{self.skipped_in_a_row} optimizer steps in a row were skipped for a "
                    "non-finite loss or gradient (engine.nonfinite=skip, "
                    f"trainer.max_consecutive_skipped_steps={self.max_skipped}); the weights "
                    "have not changed since; see actor/grad_norm in metrics.jsonl"
                ),
                checkpoint_first=False,
            )
        failed = metrics.get("reward/failed_fraction", 0.0)
        if failed > self.max_failure_fraction:
            self.failing_steps_in_a_row += 1
        else:
            self.failing_steps_in_a_row = 0
        if self.failing_steps_in_a_row >= self.max_failing_steps:
            return HealthVerdict(
                RunHealthError(
                    f"reward {self.reward_name!r} failed or timed out on more than "
                    f"{self.max_failure_fraction:.0%} of its calls in each of the last "
                    f"{self.failing_steps_in_a_row} steps (reward.max_failure_fraction, "
                    "reward.max_failing_steps); see reward/failures and reward/timeouts in "
                    "metrics.jsonl. A checkpoint was written: resume once the reward is fixed"
                ),
                checkpoint_first=True,
            )
        return None
