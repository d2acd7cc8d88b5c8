"""Rewards that misbehave on purpose, for tests of the scorer and the trainer's failure paths.

Test-only: tests import them as `rewards.faulty_rewards` (tests/ is on sys.path, pyproject's
pytest `pythonpath`), and a worker process, which starts with its parent's sys.path
(gspo_megatron/isolation/pool.py), imports them by that reference. The label chooses the
behaviour:

    "hang"   sleep for `hang_s` seconds (a hung sync call)
    "spin"   busy-loop forever (a CPU-bound hang, holding the GIL in a thread)
    "raise"  raise ValueError
    "nan"    return NaN
    "text"   return a string (not a number)
    "crash"  kill the process it runs in (only meaningful in a worker process)
    other    exact match of response and label (1.0 / 0.0)
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


def _behave(response: str, label: Any, hang_s: float) -> float:
    if label == "hang":
        time.sleep(hang_s)
    elif label == "spin":
        while True:
            pass
    elif label == "raise":
        raise ValueError(f"reward failed on purpose for {response!r}")
    elif label == "nan":
        return float("nan")
    elif label == "text":
        return "one"  # type: ignore[return-value]
    elif label == "crash":
        os._exit(3)
    return float(response == label)


class FaultyReward:
    """Sync reward whose behaviour the label picks (see the module docstring)."""

    def __init__(self, hang_s: float = 3600.0) -> None:
        self.hang_s = hang_s

    def __call__(self, prompt: str, response: str, label: Any) -> float:
        return _behave(response, label, self.hang_s)


class AsyncFaultyReward:
    """Async version: "hang" awaits asyncio.sleep (cancellable)."""

    def __init__(self, hang_s: float = 3600.0) -> None:
        self.hang_s = hang_s

    async def __call__(self, prompt: str, response: str, label: Any) -> float:
        if label == "hang":
            await asyncio.sleep(self.hang_s)
        await asyncio.sleep(0)
        return _behave(response, label, self.hang_s)


def pid_reward(prompt: str, response: str, label: Any) -> float:
    """Returns the id of the process it runs in (to check where calls run)."""
    return float(os.getpid())
