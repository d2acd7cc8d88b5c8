"""Runs that do not collapse silently (docs/STABILITY.md): the mismatch budget, the collapse
sentinel and rollbacks to the newest healthy checkpoint. The loop (trainer.py) calls them; the
guardrails are config checks (config.py) and the telemetry is measured where the data is
(step_inputs.py, the engines, algorithms/)."""

from gspo_megatron.stability.budget import BudgetAction, MismatchBudget
from gspo_megatron.stability.monitor import StabilityMonitor, Watch
from gspo_megatron.stability.rollback import (
    RollbackRecord,
    Rollbacks,
    StabilityError,
    may_roll_back_to,
)
from gspo_megatron.stability.sentinel import SIGNALS, CollapseSentinel, Firing

__all__ = [
    "SIGNALS",
    "BudgetAction",
    "CollapseSentinel",
    "Firing",
    "MismatchBudget",
    "RollbackRecord",
    "Rollbacks",
    "StabilityError",
    "StabilityMonitor",
    "Watch",
    "may_roll_back_to",
]
