"""Environment calls that may raise or hang, run so that neither stops the run.

`inline`: in the caller's thread (environments that declare `inline_safe`: bounded pure-Python
work), exceptions caught. `thread`: every call of a batch in a daemon thread of its own, all
started together and waited for until `timeout_s` after the start; a call still running then is
abandoned (Python cannot stop a thread; `abandoned` counts them) and its episode ends. Contract
violations (EnvironmentContractError) are bugs of the environment and propagate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gspo_megatron.envs.base import EnvironmentContractError

logger = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout", "contract"]


@dataclass(frozen=True)
class CallOutcome:
    status: Status
    value: Any = None
    error: str | None = None


class EnvCalls:
    def __init__(self, executor: str, timeout_s: float) -> None:
        if executor not in ("inline", "thread"):
            raise ValueError(f"env.executor must resolve to inline or thread, got {executor!r}")
        self.executor = executor
        self.timeout_s = timeout_s
        self.abandoned = 0

    def run(self, calls: Sequence[Callable[[], Any]]) -> list[CallOutcome]:
        if self.executor == "inline":
            return [_raise_contract(_call(fn)) for fn in calls]
        outcomes: list[CallOutcome | None] = [None] * len(calls)

        def target(i: int, fn: Callable[[], Any]) -> None:
            outcomes[i] = _call(fn)

        threads = [
            threading.Thread(target=target, args=(i, fn), daemon=True, name=f"env-call-{i}")
            for i, fn in enumerate(calls)
        ]
        deadline = time.monotonic() + self.timeout_s
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        done: list[CallOutcome] = []
        for t, outcome in zip(threads, outcomes, strict=True):
            if t.is_alive() or outcome is None:
                self.abandoned += 1
                done.append(CallOutcome("timeout", error=f"no answer within {self.timeout_s:g} s"))
            else:
                done.append(_raise_contract(outcome))
        return done


def _raise_contract(outcome: CallOutcome) -> CallOutcome:
    if outcome.status == "contract":
        raise outcome.value
    return outcome


def _call(fn: Callable[[], Any]) -> CallOutcome:
    try:
        return CallOutcome("ok", fn())
    except EnvironmentContractError as e:  # raised again in the caller's thread
        return CallOutcome("contract", e)
    except Exception as e:  # noqa: BLE001 - a failing environment ends its episode, counted
        logger.debug("environment call failed", exc_info=True)
        return CallOutcome("error", error=f"{type(e).__name__}: {e}")
