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
  (`python -m gspo_megatron.rewards._worker`). On timeout the worker is killed and replaced, so a
  hung call costs exactly `timeout_s` and leaves nothing behind. Why processes, not threads:
  Python cannot stop a thread, so a reward stuck in a loop (sympy simplification is the usual
  culprit) would keep burning a core and holding the GIL for the rest of the run, and a thread
  pool's threads are joined at interpreter exit, so one hung call also hangs shutdown.
  math-verify also needs the main thread for its own SIGALRM timeouts, which a worker process
  has. The workers are started with exec (not fork): forking a trainer that holds torch, gloo and
  OpenMP threads is unsafe, and exec avoids re-importing the trainer's `__main__` (what the
  `spawn` start method does, ~10 s with megatron). Cost: ~0.1 ms of IPC per call, one-off worker
  start-up (not counted in the timeout), and the function must be picklable by reference
  (defined at module level in an importable module).
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
import os
import pickle
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gspo_megatron.event_loop import LoopThread
from gspo_megatron.rewards import _protocol
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


@dataclass
class RewardBatch:
    """Rewards of one batch, in input order, with what went wrong.

    `status[i]` is "ok", "error" (raised, bad return value, worker died) or "timeout"; every
    non-ok item has reward 0. `errors` keeps the messages of the first few failures, each
    prefixed with the item index.
    """

    rewards: list[float]
    status: list[Status]
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

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
        }


class _WorkerDied(Exception):
    pass


class _Worker:
    """One reward worker process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process, reaping: set[asyncio.Task]) -> None:
        self.proc = proc
        self._reaping = reaping

    @classmethod
    async def start(
        cls, fn_bytes: bytes, startup_timeout_s: float, reaping: set[asyncio.Task]
    ) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")  # a reward worker has no use for a thread pool
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gspo_megatron.rewards._worker",
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        worker = cls(proc, reaping)
        try:
            kind, message = await asyncio.wait_for(
                worker._roundtrip((list(sys.path), fn_bytes)), startup_timeout_s
            )
        except (TimeoutError, _WorkerDied, asyncio.CancelledError) as exc:
            worker.kill()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise RewardError(f"reward worker did not start: {exc or 'timed out'}") from None
        if kind != "ready":
            worker.kill()
            raise RewardError(
                f"{message} (a process-executor reward must be importable by reference: "
                "define it at module level outside __main__, or set reward.executor=thread)"
            )
        return worker

    async def _roundtrip(self, obj: Any) -> tuple[str, Any]:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(_protocol.encode(obj))
            await stdin.drain()
            header = await stdout.readexactly(_protocol.HEADER.size)
            (size,) = _protocol.HEADER.unpack(header)
            return pickle.loads(await stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            code = await self.proc.wait()
            raise _WorkerDied(f"reward worker exited with code {code}") from exc

    async def call(self, prompt: str, response: str, label: Any) -> tuple[str, Any]:
        return await self._roundtrip((prompt, response, label))

    def kill(self) -> None:
        """Kill the process and reap it in the background (the pool awaits that on close)."""
        if self.proc.returncode is None:
            self.proc.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # lets asyncio close the transport once the process is gone
        task = asyncio.get_running_loop().create_task(self.proc.wait())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)


class _ProcessPool:
    """Up to `size` worker processes, started on demand; a timed-out worker is killed."""

    def __init__(self, fn_bytes: bytes, size: int, startup_timeout_s: float) -> None:
        self._fn_bytes = fn_bytes
        self._startup_timeout_s = startup_timeout_s
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._reaping: set[asyncio.Task] = set()

    def _start(self) -> Awaitable[_Worker]:
        return _Worker.start(self._fn_bytes, self._startup_timeout_s, self._reaping)

    async def warmup(self, n: int) -> None:
        missing = max(0, n - len(self._idle))
        starts = [self._start() for _ in range(missing)]
        started = await asyncio.gather(*starts, return_exceptions=True)
        self._idle.extend(w for w in started if isinstance(w, _Worker))
        for result in started:
            if isinstance(result, BaseException):
                raise result

    async def call(self, prompt: str, response: str, label: Any, timeout_s: float) -> _Outcome:
        async with self._slots:
            worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.returncode is not None:
                try:
                    worker = await self._start()
                except RewardError as exc:
                    return "error", 0.0, str(exc)
            self._busy.add(worker)
            try:
                kind, value = await asyncio.wait_for(
                    worker.call(prompt, response, label), timeout_s
                )
            except TimeoutError:
                worker.kill()
                return "timeout", 0.0, f"timed out after {timeout_s:g} s (worker killed)"
            except _WorkerDied as exc:
                return "error", 0.0, str(exc)
            except BaseException:
                worker.kill()
                raise
            finally:
                self._busy.discard(worker)
            self._idle.append(worker)
        if kind != "ok":
            return "error", 0.0, str(value)
        try:
            return "ok", as_reward(value), None
        except RewardError as exc:
            return "error", 0.0, str(exc)

    async def close(self) -> None:
        workers = self._idle + list(self._busy)
        self._idle, self._busy = [], set()
        for worker in workers:
            if worker.proc.stdin is not None and worker.proc.returncode is None:
                worker.proc.stdin.close()  # EOF: an idle worker exits by itself
        for worker in workers:
            try:
                await asyncio.wait_for(worker.proc.wait(), 1.0)
            except TimeoutError:
                worker.kill()
        if self._reaping:
            await asyncio.wait(list(self._reaping), timeout=5.0)


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
        self._pool: _ProcessPool | None = None
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
            loop.submit(self._get_pool().warmup(self.max_concurrency)).result()

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

    def _get_pool(self) -> _ProcessPool:
        if self._pool is None:  # created on the loop thread's first use
            self._pool = _ProcessPool(self._fn_bytes, self.max_concurrency, self._startup_timeout_s)
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
            return await self._get_pool().call(prompt, response, label, self.timeout_s)
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
