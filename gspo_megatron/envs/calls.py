"""Environment calls that may raise or hang, run so that neither stops the run.

Every call is `env_call(env, method, args, factory)`: the episode's environment (built with
`factory` = (class, kwargs) when it is None) runs `method(*args)`; the call returns the
environment (it holds the episode's state) and the method's result. Where calls run
(`env.executor`):

- `inline`: in the trainer's thread, no timeout (classes that declare `inline_safe`: bounded
  pure-Python work).
- `thread`: every call in a daemon thread of its own, answered "timeout" `timeout_s` after it
  started. Python cannot stop a thread: a call still running then is abandoned (counted in
  env/timeouts) and may keep a core busy.
- `process` (default for classes that are not inline_safe): a pool of `env.workers` worker
  processes (gspo_megatron/isolation, as reward.executor=process). The environment travels
  pickled with each call, so its state must pickle and its class be importable by reference; a
  worker past the timeout is killed and replaced, so a hung call costs exactly `timeout_s`.

`submit` starts one call and returns a future of its `CallOutcome` at once, so each episode
calls its environment when it needs to (rollout/episodes.py) and a slow call holds up only its
own episode; `run` is `submit` for many calls, waited for together. A call that raises or runs
past the timeout ends its episode only (reward 0, counted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import pickle
import threading
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
        self._starting = threading.Lock()  # episodes of several batches call at once

    def run(self, calls: Sequence[Call]) -> list[CallOutcome]:
        futures = [self.submit(call) for call in calls]
        return [f.result() for f in futures]

    def submit(self, call: Call) -> concurrent.futures.Future:
        """Start `call`; the future gives its CallOutcome (never an exception)."""
        if self.executor == "inline":
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self._inline(*call))
            return done
        if self.executor == "process":
            return self._in_process(call)
        return self._in_thread(call)

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

    def _in_thread(self, call: Call) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def answer(outcome: CallOutcome) -> None:
            # the first of the call and its timeout answers
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_result(outcome)

        timeout = CallOutcome("timeout", error=f"no answer within {self.timeout_s:g} s")
        timer = threading.Timer(self.timeout_s, answer, (timeout,))
        timer.daemon = True
        thread = threading.Thread(
            target=lambda: answer(self._inline(*call)), daemon=True, name="env-call"
        )
        timer.start()
        thread.start()
        future.add_done_callback(lambda _: timer.cancel())
        return future

    def _in_process(self, call: Call) -> concurrent.futures.Future:
        with self._starting:
            if self._loop is None:
                self._loop = LoopThread("env-loop")
                # The class travels with the function, so a worker imports its module while
                # it starts, not within a call's timeout.
                fn = functools.partial(env_call, factory=self.factory, pickled=True)
                self._pool = ProcessPool(pickle.dumps(fn), self.workers, 120.0, _PROCESS_HINT)
        env, method, args = call
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        def done(job: concurrent.futures.Future) -> None:
            try:
                status, value, error = job.result()
            except BaseException as e:  # noqa: BLE001 - the pool closed under the call
                status, value, error = "error", None, f"{type(e).__name__}: {e}"
            outcome.set_result(CallOutcome(status, value, error))

        self._loop.submit(self._pool.call((env, method, args), self.timeout_s)).add_done_callback(
            done
        )
        return outcome
