"""Environment calls that may raise or hang, run so that neither stops the run.

Every call is `env_call(env, method, args, factory)`: the episode's environment (built with
`factory` = (class, kwargs) when it is None) runs `method(*args)`; the call returns the
environment (it holds the episode's state) and the method's result. Where calls run
(`env.executor`):

- `inline`: in the trainer's thread, no timeout (classes that declare `inline_safe`: bounded
  pure-Python work).
- `thread`: every call of a turn in a daemon thread of its own, all started together and waited
  for until `timeout_s` after the start. Python cannot stop a thread: a call still running then
  is abandoned (counted in env/timeouts) and may keep a core busy.
- `process` (default for classes that are not inline_safe): a pool of `env.workers` worker
  processes (gspo_megatron/isolation, as reward.executor=process). The environment travels
  pickled with each call, so its state must pickle and its class be importable by reference; a
  worker past the timeout is killed and replaced, so a hung call costs exactly `timeout_s`.

A call that raises or runs past the timeout ends its episode only (reward 0, counted).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gspo_megatron.event_loop import LoopThread
from gspo_megatron.isolation import ProcessPool

logger = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout"]
Call = tuple[Any, str, tuple]  # (environment or None, method, arguments)
_PROCESS_HINT = (
    "(an environment run with env.executor=process must be importable by reference and its "
    "state picklable; or set env.executor=thread)"
)


@dataclass(frozen=True)
class CallOutcome:
    status: Status
    value: Any = None  # (environment, result) when ok
    error: str | None = None


def env_call(env: Any, method: str, args: tuple, *, factory: tuple, pickled: bool = False):
    """(environment, result) of `method(*args)`; `pickled`: the environment travels as bytes."""
    if pickled and env is not None:
        env = pickle.loads(env)
    if env is None:
        cls, kwargs = factory
        env = cls(**kwargs)
    result = getattr(env, method)(*args)
    return (pickle.dumps(env) if pickled else env), result


class EnvCalls:
    def __init__(self, executor: str, timeout_s: float, factory: tuple, workers: int = 4) -> None:
        if executor not in ("inline", "thread", "process"):
            raise ValueError(
                f"env.executor must resolve to inline, thread or process: {executor!r}"
            )
        self.executor = executor
        self.timeout_s = timeout_s
        self.factory = factory
        self.workers = workers
        self._loop: LoopThread | None = None
        self._pool: ProcessPool | None = None

    def run(self, calls: Sequence[Call]) -> list[CallOutcome]:
        if self.executor == "inline":
            return [self._inline(env, method, args) for env, method, args in calls]
        if self.executor == "process":
            return self._in_processes(calls)
        return self._in_threads(calls)

    def close(self) -> None:
        if self._loop is not None:
            if self._pool is not None:
                self._loop.submit(self._pool.close()).result(timeout=30)
            self._loop.close()
            self._loop = self._pool = None

    def _inline(self, env: Any, method: str, args: tuple) -> CallOutcome:
        try:
            return CallOutcome("ok", env_call(env, method, args, factory=self.factory))
        except Exception as e:  # noqa: BLE001 - a failing environment ends its episode, counted
            logger.debug("environment call failed", exc_info=True)
            return CallOutcome("error", error=f"{type(e).__name__}: {e}")

    def _in_threads(self, calls: Sequence[Call]) -> list[CallOutcome]:
        outcomes: list[CallOutcome | None] = [None] * len(calls)

        def target(i: int, call: Call) -> None:
            outcomes[i] = self._inline(*call)

        threads = [
            threading.Thread(target=target, args=(i, call), daemon=True, name=f"env-call-{i}")
            for i, call in enumerate(calls)
        ]
        deadline = time.monotonic() + self.timeout_s
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        done = []
        for t, outcome in zip(threads, outcomes, strict=True):
            if t.is_alive() or outcome is None:
                outcome = CallOutcome("timeout", error=f"no answer within {self.timeout_s:g} s")
            done.append(outcome)
        return done

    def _in_processes(self, calls: Sequence[Call]) -> list[CallOutcome]:
        if self._loop is None:
            self._loop = LoopThread("env-loop")
            # The class travels with the function, so a worker imports its module while it
            # starts, not within a call's timeout.
            fn = functools.partial(env_call, factory=self.factory, pickled=True)
            self._pool = ProcessPool(pickle.dumps(fn), self.workers, 120.0, _PROCESS_HINT)
        pool = self._pool

        async def all_calls() -> list:
            return await asyncio.gather(
                *(pool.call((env, method, args), self.timeout_s) for env, method, args in calls)
            )

        outcomes = self._loop.run(all_calls())
        return [CallOutcome(status, value, error) for status, value, error in outcomes]
