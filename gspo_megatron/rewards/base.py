"""The reward interface.

A reward function is any callable `reward(prompt: str, response: str, label) -> float`, plain or
`async`. `label` is whatever the data set stores for the prompt (a gold answer string, a target
digit string, a dict...). Rewards are scored in batches by `RewardScorer`, which turns an
exception, a bad return value or a timeout into reward 0 and counts it.

A reward object may also have `answer(response) -> str | None`: the answer a response gives
(None: it gives none), which evaluation's maj@k votes with (the math, exact-match and synthetic
rewards have it; without it maj@k is not reported).

A reward class may set the class attribute `inline_safe = True` to declare that a call finishes in
bounded, short time without I/O (pure Python on short strings). The scorer then runs it in the
calling thread with no timeout machinery; everything else runs where a hang cannot stall the run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any

RewardFn = Callable[[str, str, Any], float | Awaitable[float]]


class RewardError(Exception):
    """A reward call failed; the scorer records the message and uses reward 0."""


def is_async_reward(fn: RewardFn) -> bool:
    """True for `async def` functions and objects whose `__call__` is `async def`."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - we need the bound __call__ itself
    return call is not None and inspect.iscoroutinefunction(call)


def is_inline_safe(fn: RewardFn) -> bool:
    """True when `fn` declares `inline_safe = True` (bounded time, no I/O)."""
    return bool(getattr(fn, "inline_safe", False))


def reward_name(fn: RewardFn) -> str:
    """A readable name for logs: the function's qualified name or the object's class name."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{name}" if module else name


def as_reward(value: Any) -> float:
    """Validate a reward function's return value: a finite real number (bools allowed)."""
    if isinstance(value, bool):
        return float(value)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"reward function returned {type(value).__name__} {value!r:.80}, expected a float"
        ) from None
    if not math.isfinite(out):
        raise RewardError(f"reward function returned a non-finite value {out}")
    return out
