"""Rollbacks (docs/STABILITY.md, "The collapse sentinel", "Firing"): when the sentinel fires,
the run goes back to the newest healthy checkpoint saved before its signals started, applies the
remedy, and goes on from there; a bounded number of times, then it stops loudly.

The history is `rollbacks.json` in the run directory (kept by the checkpoint store,
run_files.RunCheckpoints), written before anything moves: a rollback is recorded as started,
then the checkpoints after its target and the metrics after it are moved aside (never deleted),
the target is loaded, and the record is marked done. A run killed at any point completes the
recorded rollback when it resumes. What the run does after a rollback is a function of the
config, the seed and this history: the data position (the recorded one when the remedy skips
the window), the learning rate (lowered for the steps after each rollback's target), and the
sampling seeds (each rollback starts a new timeline of them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gspo_megatron.config import SentinelSection
from gspo_megatron.notes import note
from gspo_megatron.stability.sentinel import Firing


class StabilityError(RuntimeError):
    """The run cannot go on safely; the message says why, and which setting governs it."""


@dataclass
class RollbackRecord:
    """One rollback: fired at step `fired_at` by `signals` (running since `since`), back to the
    checkpoint of step `to_step`. `sampler`: the data position to go on from (the remedy skips
    the window), else None (the checkpoint's). `lr_factor` x the learning rate for the
    `lr_steps` steps after `to_step`. `status`: started | done | abandoned."""

    index: int
    fired_at: int
    since: int
    to_step: int
    checkpoint: str
    signals: dict[str, str]
    remedy: str
    sampler: dict[str, Any] | None = None
    lr_factor: float = 1.0
    lr_steps: int = 0
    status: str = "started"
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RollbackRecord:
        return cls(**data)

    def summary(self) -> str:
        return f"step {self.fired_at} -> {self.to_step} ({', '.join(self.signals)})"


def may_roll_back_to(step: int, health: dict[str, Any] | None, since: int) -> bool:
    """Whether the checkpoint of `step` is a rollback target for signals running since `since`:
    step + 1 < since (the rollouts of step + 1 come from the checkpoint's weights, so that step
    must have been clean too) and no signal was running when it was saved (checkpoints of
    earlier versions, with no health recorded, count as healthy)."""
    return step + 1 < since and (health is None or bool(health.get("healthy", True)))


class Rollbacks:
    """The run's rollback history and the two halves of a rollback, over the checkpoint store
    (`rollbacks`, `save_rollbacks`, `rollback_target`, `roll_back`: run_files.RunCheckpoints)
    and the metrics log (`rewind`)."""

    def __init__(self, settings: SentinelSection, checkpoints, log) -> None:
        self.settings = settings
        self.files = checkpoints
        self.log = log
        self.history: list[RollbackRecord] = []

    def load(self) -> None:
        self.history = [RollbackRecord.from_dict(r) for r in self.files.rollbacks()]

    @property
    def timeline(self) -> int:
        """Rollbacks so far: every one draws the sampling seeds of a new timeline."""
        return len(self.history)

    def interrupted(self) -> RollbackRecord | None:
        """A rollback recorded as started that a killed run did not finish."""
        last = self.history[-1] if self.history else None
        return last if last is not None and last.status == "started" else None

    def lr_scale(self, step: int) -> float:
        """The factor on the policy's learning rate at RL step `step` (1-based): each rollback
        lowers it for the lr_steps steps after its target; overlapping windows multiply."""
        scale = 1.0
        for r in self.history:
            if r.status != "abandoned" and r.to_step < step <= r.to_step + r.lr_steps:
                scale *= r.lr_factor
        return scale

    def start(self, firing: Firing, engine, companions, sampler_state: dict) -> RollbackRecord:
        """Choose the target and record the rollback (rollbacks.json) before anything moves;
        StabilityError when none is left or there is nothing to roll back to."""
        s = self.settings
        if len(self.history) >= s.max_rollbacks:
            done = "; ".join(r.summary() for r in self.history)
            raise StabilityError(
                f"the collapse sentinel fired at step {firing.step} ({firing.describe()}) after "
                f"{len(self.history)} rollback(s), the most stability.sentinel.max_rollbacks="
                f"{s.max_rollbacks} allows: stopping. Rollbacks: {done} (rollbacks.json; the "
                "records they replaced are in metrics.superseded.jsonl)"
            )
        target = self.files.rollback_target(
            engine, lambda step, health: may_roll_back_to(step, health, firing.since), companions
        )
        if target is None:
            raise StabilityError(
                f"the collapse sentinel fired at step {firing.step} ({firing.describe()}); its "
                f"signals started at step {firing.since}, and no healthy checkpoint of step "
                f"{firing.since - 2} or earlier is there to roll back to: stopping. Checkpoints "
                "come every trainer.save_every steps or trainer.save_every_minutes"
            )
        step, name = target
        record = RollbackRecord(
            index=len(self.history) + 1,
            fired_at=firing.step,
            since=firing.since,
            to_step=step,
            checkpoint=name,
            signals=dict(firing.signals),
            remedy=s.remedy,
            sampler=dict(sampler_state) if s.skips_window else None,
            lr_factor=s.lr_factor if s.lowers_lr else 1.0,
            lr_steps=s.lr_steps if s.lowers_lr else 0,
        )
        self.history.append(record)
        self._save()
        remedy = {
            "skip_window_lower_lr": f"the prompts of steps {step + 1}-{firing.step} skipped, the "
            f"learning rate x{s.lr_factor:g} for {s.lr_steps} steps",
            "skip_window": f"the prompts of steps {step + 1}-{firing.step} skipped",
            "lower_lr": f"the learning rate x{s.lr_factor:g} for {s.lr_steps} steps",
            "resample": "the same prompts with new sampling seeds",
        }[s.remedy]
        note(
            f"step {firing.step}: the collapse sentinel fired ({firing.describe()}; signals since "
            f"step {firing.since}): rollback {record.index} of at most {s.max_rollbacks} to "
            f"{name}; remedy {s.remedy}: {remedy}"
        )
        return record

    def finish(self, record: RollbackRecord, engine, companions, *, validate: bool) -> dict:
        """Load the target (the checkpoints after it and the metrics after it moved aside) and
        mark the rollback done; returns the trainer state saved with the target."""
        state = self.files.roll_back(
            engine,
            record.to_step,
            reason=f"rolled back from step {record.fired_at} to step {record.to_step} "
            f"(rollback {record.index}: {', '.join(record.signals)})",
            companions=companions,
            validate=validate,
        )
        self.log.rewind(record.to_step)
        record.status = "done"
        self._save()
        return state

    def abandon(self, record: RollbackRecord, why: str) -> None:
        record.status = "abandoned"
        self._save()
        note(f"rollback {record.index} ({record.summary()}) was not completed: {why}")

    def pending_for(self, state: dict[str, Any]) -> RollbackRecord | None:
        """The rollback a resumed checkpoint still owes its remedy: the last one when it was
        recorded after the checkpoint was saved and targets it (the run was killed after it
        finished, before another checkpoint)."""
        saved_with = int(state.get("rollbacks", 0))
        later = [r for r in self.history[saved_with:] if r.status == "done"]
        if not later:
            return None
        last = later[-1]
        if last.to_step != int(state["step"]):
            note(
                f"resumed at step {state['step']}, not at the target of rollback {last.index} "
                f"(step {last.to_step}): its data window is not skipped"
            )
            return None
        return last

    def _save(self) -> None:
        self.files.save_rollbacks([r.as_dict() for r in self.history])
