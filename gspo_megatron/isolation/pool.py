"""A pool of worker processes that run one pickled function, with a timeout per call.

Why processes (rewards with reward.executor=process, environments with env.executor=process):
Python cannot stop a thread, so a call stuck in a loop would keep burning a core and holding
the GIL for the rest of the run; a worker process is killed on timeout and replaced, so a hung
call costs exactly its timeout and leaves nothing behind. The workers are started with exec
(`python -m gspo_megatron.isolation.worker`), not fork: forking a trainer that holds torch,
gloo and OpenMP threads is unsafe, and exec avoids re-importing the trainer's `__main__` (what
the `spawn` start method does, ~10 s with megatron). Cost: ~0.1 ms of IPC per call and a one-off
start-up per worker (not counted in the timeout); the function must be picklable by reference.
The pool lives on an asyncio loop (`gspo_megatron.event_loop.LoopThread`).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
from collections.abc import Awaitable
from typing import Any, Literal

from gspo_megatron.isolation import protocol

Outcome = tuple[Literal["ok", "error", "timeout"], Any, "str | None"]


class WorkerDied(Exception):
    """A worker process exited during a call."""


class WorkerStartError(Exception):
    """A worker process did not start (or could not load the function)."""


class Worker:
    """One worker process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process, reaping: set[asyncio.Task]) -> None:
        self.proc = proc
        self._reaping = reaping

    @classmethod
    async def start(
        cls, fn_bytes: bytes, startup_timeout_s: float, reaping: set[asyncio.Task], hint: str
    ) -> Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")  # a worker has no use for a thread pool
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gspo_megatron.isolation.worker",
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        worker = cls(proc, reaping)
        try:
            kind, message = await asyncio.wait_for(
                worker.roundtrip((list(sys.path), fn_bytes)), startup_timeout_s
            )
        except (TimeoutError, WorkerDied, asyncio.CancelledError) as exc:
            worker.kill()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise WorkerStartError(f"worker did not start: {exc or 'timed out'}") from None
        if kind != "ready":
            worker.kill()
            raise WorkerStartError(f"{message} {hint}")
        return worker

    async def roundtrip(self, obj: Any) -> tuple[str, Any]:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(protocol.encode(obj))
            await stdin.drain()
            header = await stdout.readexactly(protocol.HEADER.size)
            (size,) = protocol.HEADER.unpack(header)
            return pickle.loads(await stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            code = await self.proc.wait()
            raise WorkerDied(f"worker exited with code {code}") from exc

    def kill(self) -> None:
        """Kill the process and reap it in the background (the pool awaits that on close)."""
        if self.proc.returncode is None:
            self.proc.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # lets asyncio close the transport once the process is gone
        task = asyncio.get_running_loop().create_task(self.proc.wait())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)


class ProcessPool:
    """Up to `size` worker processes running `fn_bytes` (a pickled function), started on
    demand; a worker whose call runs past its timeout is killed and replaced. `hint` follows
    the message of a worker that cannot load the function (what to do about it)."""

    def __init__(self, fn_bytes: bytes, size: int, startup_timeout_s: float, hint: str) -> None:
        self._fn_bytes = fn_bytes
        self._hint = hint
        self._startup_timeout_s = startup_timeout_s
        self._slots = asyncio.Semaphore(size)
        self._idle: list[Worker] = []
        self._busy: set[Worker] = set()
        self._reaping: set[asyncio.Task] = set()

    def _start(self) -> Awaitable[Worker]:
        return Worker.start(self._fn_bytes, self._startup_timeout_s, self._reaping, self._hint)

    async def warmup(self, n: int) -> None:
        missing = max(0, n - len(self._idle))
        starts = [self._start() for _ in range(missing)]
        started = await asyncio.gather(*starts, return_exceptions=True)
        self._idle.extend(w for w in started if isinstance(w, Worker))
        for result in started:
            if isinstance(result, BaseException):
                raise result

    async def call(self, args: tuple, timeout_s: float) -> Outcome:
        """fn(*args) in a worker: ("ok", value, None), or ("error" | "timeout", None, why)."""
        async with self._slots:
            worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.returncode is not None:
                try:
                    worker = await self._start()
                except WorkerStartError as exc:
                    return "error", None, str(exc)
            self._busy.add(worker)
            try:
                kind, value = await asyncio.wait_for(worker.roundtrip(args), timeout_s)
            except TimeoutError:
                worker.kill()
                return "timeout", None, f"timed out after {timeout_s:g} s (worker killed)"
            except WorkerDied as exc:
                return "error", None, str(exc)
            except BaseException:
                worker.kill()
                raise
            finally:
                self._busy.discard(worker)
            self._idle.append(worker)
        if kind != "ok":
            return "error", None, str(value)
        return "ok", value, None

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
