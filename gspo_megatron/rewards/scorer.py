"""Batched reward scoring with a per-call timeout and bounded concurrency.

    scorer = RewardScorer(fn, timeout_s=10, max_concurrency=8)
    batch = scorer.score(prompts, responses, labels)   # RewardBatch
    batch.rewards, batch.num_failures, batch.num_timeouts, batch.metrics()
    scorer.close()

A call that raises, returns something that is not a finite number, or runs past `timeout_s`
gives reward 0 and is counted; the run goes on. Where a call runs (`executor`):

- `async` functions run on the scorer's own event loop (one background thread that lives as long
  as the scorer, so HTTP sessions are reused); a timeout cancels them.
- `process` (default for plain functions): a pool of worker processes
  (gspo_megatron/isolation: exec'd workers, killed and replaced on timeout, so a hung call costs
  exactly `timeout_s` and leaves nothing behind). Why processes, not threads: Python cannot stop
  a thread, so a reward stuck in a loop (sympy simplification is the usual culprit) would keep
  burning a core and holding the GIL for the rest of the run, and a thread pool's threads are
  joined at interpreter exit, so one hung call also hangs shutdown. math-verify also needs the
  main thread for its own SIGALRM timeouts, which a worker process has. The function must be
  picklable by reference (defined at module level in an importable module).
- `thread`: a daemon thread per call, for functions that cannot be pickled. A timed-out call is
  abandoned (reward 0, counted); its thread may keep running, and `abandoned_threads` says how
  many do. Daemon threads never block exit.
- `inline`: in the calling thread, no timeout. Only for functions that declare
  `inline_safe = True` (the synthetic tasks, exact match): bounded pure-Python string work.
- `auto` picks: async -> event loop; inline_safe -> inline; picklable -> process; else thread
  (with a warning).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import statistics
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gspo_megatron.event_loop import LoopThread
from gspo_megatron.isolation import ProcessPool, WorkerStartError
from gspo_megatron.rewards.base import (
    RewardError,
    RewardFn,
    as_reward,
    is_async_reward,
    is_inline_safe,
    reward_name,
)

logger = logging.getLogger(__name__)

Executor = Literal["auto", "inline", "thread", "process"]
Status = Literal["ok", "error", "timeout"]
EXECUTORS = ("auto", "inline", "thread", "process")

_Outcome = tuple[Status, float, str | None]  # (status, reward, error message)
_PROCESS_HINT = (
    "(a process-executor reward must be importable by reference: define it at module level "
    "outside __main__, or set reward.executor=thread)"
)


@dataclass
class RewardBatch:
    """Rewards of one batch, in input order, with what went wrong.

    `status[i]` is "ok", "error" (raised, bad return value, worker died) or "timeout"; every
    non-ok item has reward 0. `errors` keeps the messages of the first few failures, each
    prefixed with the item index. `details`: counts the reward reports about this batch (a
    reward with a `pop_metrics()` method, e.g. the code reward's outcome reasons).
    """

    rewards: list[float]
    status: list[Status]
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    details: dict[str, float] = field(default_factory=dict)

    @property
    def num_failures(self) -> int:
        return sum(s == "error" for s in self.status)

    @property
    def num_timeouts(self) -> int:
        return sum(s == "timeout" for s in self.status)

    def accuracy(self, threshold: float = 1.0) -> float:
        """Fraction of items with reward >= threshold (full credit = solved)."""
        if not self.rewards:
            return 0.0
        return sum(r >= threshold for r in self.rewards) / len(self.rewards)

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        n = len(self.rewards)
        return {
            f"{prefix}mean": statistics.fmean(self.rewards) if n else 0.0,
            f"{prefix}std": statistics.pstdev(self.rewards) if n else 0.0,
            f"{prefix}accuracy": self.accuracy(),
            f"{prefix}failures": float(self.num_failures),
            f"{prefix}timeouts": float(self.num_timeouts),
            f"{prefix}time_s": self.elapsed_s,
        } | {f"{prefix}{name}": value for name, value in self.details.items()}


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class RewardScorer:
    """Scores batches of (prompt, response, label) with one reward function.

    Args:
        fn: `reward(prompt, response, label) -> float`, plain or async.
        timeout_s: limit for one call (worker start-up not included).
        max_concurrency: calls in flight at once; for `process`, the number of worker processes
            (set it near the number of free cores for CPU-bound rewards).
        executor: "auto" | "inline" | "thread" | "process" (see the module docstring).
        startup_timeout_s: limit for starting one worker process.
        max_error_messages: failure messages kept per batch.
    """

    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout_s: float = 10.0,
        max_concurrency: int = 8,
        executor: Executor = "auto",
        startup_timeout_s: float = 120.0,
        max_error_messages: int = 8,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"reward function must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        if max_concurrency < 1:
            raise ValueError(f"reward.max_concurrency must be >= 1, got {max_concurrency}")
        if executor not in EXECUTORS:
            raise ValueError(f"reward.executor must be one of {EXECUTORS}, got {executor!r}")
        self.fn = fn
        self.name = reward_name(fn)
        self.timeout_s = float(timeout_s)
        self.max_concurrency = int(max_concurrency)
        self.max_error_messages = int(max_error_messages)
        self.is_async = is_async_reward(fn)
        self.executor = self._resolve_executor(executor)
        self._fn_bytes = pickle.dumps(fn) if self.executor == "process" else b""
        self._startup_timeout_s = startup_timeout_s
        self._loop: LoopThread | None = None
        self._pool: ProcessPool | None = None
        self._abandoned: set[threading.Thread] = set()
        self._closed = False

    def _resolve_executor(self, requested: Executor) -> str:
        if self.is_async:
            if requested != "auto":
                raise ValueError(
                    f"reward {self.name} is async; it runs on the scorer's event loop, so "
                    f"reward.executor={requested} does not apply: set reward.executor=auto"
                )
            return "async"
        if requested == "inline" and not is_inline_safe(self.fn):
            raise ValueError(
                f"reward {self.name} does not declare inline_safe = True; running it inline "
                "would let a hang stall the run: set reward.executor=auto, process or thread"
            )
        if requested == "process":
            self._check_picklable()
        if requested != "auto":
            return requested
        if is_inline_safe(self.fn):
            return "inline"
        try:
            self._check_picklable()
        except ValueError as exc:
            logger.warning("%s; using reward.executor=thread (hangs are abandoned)", exc)
            return "thread"
        return "process"

    def _check_picklable(self) -> None:
        module = getattr(self.fn, "__module__", None) or type(self.fn).__module__
        problem = None
        if module == "__main__":
            problem = "it is defined in __main__, which worker processes cannot import"
        else:
            try:
                pickle.loads(pickle.dumps(self.fn))
            except Exception as exc:
                problem = f"it cannot be pickled ({exc})"
        if problem:
            raise ValueError(
                f"reward {self.name} cannot run in a worker process: {problem}; define it at "
                "module level in an importable module, or set reward.executor=thread"
            )

    # ------------------------------------------------------------------ public API

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[Any] | None = None,
    ) -> RewardBatch:
        """Rewards for each (prompt, response, label), in order. Never raises for a bad call."""
        start, running = self._start(prompts, responses, labels)
        outcomes = running if isinstance(running, list) else running.result()
        return self._batch(outcomes, time.perf_counter() - start)

    async def ascore(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[Any] | None = None,
    ) -> RewardBatch:
        """`score` for callers that run their own event loop (the work runs on the scorer's)."""
        start, running = self._start(prompts, responses, labels)
        outcomes = running if isinstance(running, list) else await asyncio.wrap_future(running)
        return self._batch(outcomes, time.perf_counter() - start)

    def _start(self, prompts, responses, labels):
        """(start time, outcomes): the outcomes themselves when scored inline, else the future of
        the scorer's loop computing them."""
        items = self._items(prompts, responses, labels)
        start = time.perf_counter()
        if self.executor == "inline":
            return start, [self._call_inline(*item) for item in items]
        return start, self._ensure_loop().submit(self._score_async(items))

    def warmup(self) -> None:
        """Start the worker processes now (they otherwise start on first use)."""
        if self.executor == "process":
            loop = self._ensure_loop()
            try:
                loop.submit(self._get_pool().warmup(self.max_concurrency)).result()
            except WorkerStartError as exc:
                raise RewardError(f"reward worker: {exc}") from None

    @property
    def abandoned_threads(self) -> int:
        """Timed-out `thread`-executor calls whose threads are still running."""
        self._abandoned = {t for t in self._abandoned if t.is_alive()}
        return len(self._abandoned)

    def close(self) -> None:
        """Stop worker processes and the event loop; close the reward's resources (aclose)."""
        if self._closed:
            return
        self._closed = True
        if self._loop is None:
            return
        fut = self._loop.submit(self._aclose())
        try:
            fut.result(timeout=30)
        except Exception as exc:  # closing must not mask the caller's own error
            logger.warning("closing reward %s: %r", self.name, exc)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _items(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any] | None
    ) -> list[tuple[int, str, str, Any]]:
        if self._closed:
            raise RuntimeError(f"reward scorer for {self.name} is closed")
        if labels is None:
            labels = [None] * len(prompts)
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(
                f"score() needs equal lengths: {len(prompts)} prompts, {len(responses)} "
                f"responses, {len(labels)} labels"
            )
        rows = zip(prompts, responses, labels, strict=True)
        return [(i, p, r, lab) for i, (p, r, lab) in enumerate(rows)]

    def _ensure_loop(self) -> LoopThread:
        if self._loop is None:
            self._loop = LoopThread("reward-loop")
        return self._loop

    def _get_pool(self) -> ProcessPool:
        if self._pool is None:  # created on the loop thread's first use
            self._pool = ProcessPool(
                self._fn_bytes, self.max_concurrency, self._startup_timeout_s, _PROCESS_HINT
            )
        return self._pool

    def _call_inline(self, i: int, prompt: str, response: str, label: Any) -> _Outcome:
        try:
            value = self.fn(prompt, response, label)
            if isinstance(value, Awaitable):
                raise RewardError("an inline reward returned an awaitable")
            return "ok", as_reward(value), None
        except Exception as exc:
            return "error", 0.0, f"{type(exc).__name__}: {exc}"

    async def _score_async(self, items: list[tuple[int, str, str, Any]]) -> list[_Outcome]:
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(item: tuple[int, str, str, Any]) -> _Outcome:
            async with sem:
                return await self._call_one(*item)

        return await asyncio.gather(*(one(item) for item in items))

    async def _call_one(self, i: int, prompt: str, response: str, label: Any) -> _Outcome:
        if self.executor == "process":
            status, value, error = await self._get_pool().call(
                (prompt, response, label), self.timeout_s
            )
            if status != "ok":
                return status, 0.0, error
            try:
                return "ok", as_reward(value), None
            except RewardError as exc:
                return "error", 0.0, str(exc)
        try:
            if self.executor == "async":
                value = await asyncio.wait_for(self.fn(prompt, response, label), self.timeout_s)
            else:
                value = await self._call_in_thread(i, prompt, response, label)
            return "ok", as_reward(value), None
        except TimeoutError:
            return "timeout", 0.0, f"timed out after {self.timeout_s:g} s"
        except Exception as exc:
            return "error", 0.0, f"{type(exc).__name__}: {exc}"

    async def _call_in_thread(self, i: int, prompt: str, response: str, label: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def target() -> None:
            try:
                ok, value = True, self.fn(prompt, response, label)
            except BaseException as exc:
                ok, value = False, exc
            with contextlib.suppress(RuntimeError):  # the loop closed while an abandoned call ran
                loop.call_soon_threadsafe(_settle, fut, ok, value)

        thread = threading.Thread(target=target, name=f"reward-call-{i}", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            self._abandoned.add(thread)
            raise

    async def _aclose(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        aclose = getattr(self.fn, "aclose", None)
        if aclose is not None:
            await aclose()

    def _batch(self, outcomes: list[_Outcome], elapsed_s: float) -> RewardBatch:
        batch = RewardBatch(
            rewards=[o[1] for o in outcomes],
            status=[o[0] for o in outcomes],
            errors=[f"item {i}: {o[2]}" for i, o in enumerate(outcomes) if o[0] != "ok"][
                : self.max_error_messages
            ],
            elapsed_s=elapsed_s,
        )
        pop_metrics = getattr(self.fn, "pop_metrics", None)
        if pop_metrics is not None:
            batch.details = pop_metrics()
        if batch.errors:
            logger.warning(
                "reward %s: %d of %d calls gave reward 0 (%d failed, %d timed out); first: %s",
                self.name,
                batch.num_failures + batch.num_timeouts,
                len(outcomes),
                batch.num_failures,
                batch.num_timeouts,
                batch.errors[0],
            )
        return batch
