"""The code-execution reward (`reward=code`): runs the response's program on the label's tests
in the sandbox (gspo_megatron/sandbox) and scores what passed.

    reward = CodeReward(scoring="all", test_timeout_s=6)
    outcome = await reward.evaluate(prompt, response, label)   # CodeOutcome: reward, reason
    value = await reward(prompt, response, label)               # the scorer's call: a float

Scoring: "all" (1 when every test passes, else 0; tests run in order and stop at the first
failure), "fraction" (the share of tests passed) or "partial" (per test, the share of output
characters right position by position: the dense signal a model learning from scratch needs,
used by the synthetic `expr` task). A program longer than the problem's max_program_chars
scores 0 (too_long) without running, except under "partial", where it runs and earns its
credit times max_program_chars / its length: extra characters cost credit as extra positions
do in the synthetic tasks, and such a program never earns 1. Every outcome has a named
reason: passed, wrong_answer,
runtime_error, timeout, cpu_time, memory, output_limit, signal, slot_lost (the first failing
test's), no_program, too_long. They are counted and reported per batch as
reward/code/<reason>.

A sandbox that cannot run a program (sandbox_error) is the grader's failure, not the
program's: the call raises RewardError, which the scorer counts as a failed reward call. A
slot that died under a program (slot_lost: rebuilt for the next run) scores that program 0.

Outcomes are cached by (program, problem, settings): an LRU of `cache_size` entries, and
identical programs in flight share one run. Programs that read randomness or the clock may
get a different outcome on a rerun; the cached one stands.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from gspo_megatron.rewards.base import RewardError
from gspo_megatron.rewards.code.problems import (
    EXTRACTIONS,
    CodeProblem,
    TestCase,
    call_result_matches,
    extract_program,
    parse_problem,
    position_credit,
    stdout_matches,
)
from gspo_megatron.sandbox import RunResult, Sandbox, SandboxConfig, SandboxLimits

logger = logging.getLogger(__name__)

SCORINGS = ("all", "fraction", "partial")
REASONS = (
    "passed", "wrong_answer", "runtime_error", "timeout", "cpu_time", "memory",
    "output_limit", "signal", "slot_lost", "no_program", "too_long",
)  # fmt: skip


@dataclass
class TestOutcome:
    status: str  # passed, wrong_answer, or the run's status (timeout, memory, ...)
    credit: float
    wall_s: float
    stderr: str = ""


@dataclass
class CodeOutcome:
    reward: float
    reason: str
    tests: list[TestOutcome] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "reason": self.reason,
            "tests": [{"status": t.status, "wall_s": round(t.wall_s, 4)} for t in self.tests],
        }


class CodeReward:
    """Async reward: the scorer runs it on its event loop, `max_concurrency` calls at once;
    the sandbox runs at most `workers` programs at once (null = the CPUs of this process).

    Args:
        scoring: all | fraction | partial (module docstring).
        extract: fenced (the last ```python block after any </think>) | raw (the response).
        language: a key of gspo_megatron.sandbox.LANGUAGES.
        test_timeout_s: wall-clock limit per test (a label's time_limit_s overrides it).
        memory_mb, processes, max_output_bytes, disk_mb: per-run limits (SandboxLimits).
        max_program_chars: longer programs score 0 (too_long) without running.
        workers, namespaces, seccomp, prewarm, python: the sandbox (SandboxConfig).
        cache_size: outcomes kept (0 = no cache).
    """

    def __init__(
        self,
        scoring: str = "all",
        extract: str = "fenced",
        language: str = "python",
        test_timeout_s: float = 6.0,
        memory_mb: int = 1024,
        processes: int = 16,
        max_output_bytes: int = 1 << 20,
        disk_mb: int = 16,
        max_program_chars: int = 100_000,
        workers: int | None = None,
        namespaces: bool = True,
        seccomp: bool = True,
        prewarm: bool = True,
        python: str | None = None,
        cache_size: int = 65536,
    ) -> None:
        if scoring not in SCORINGS:
            raise ValueError(f"code reward scoring must be one of {SCORINGS}, got {scoring!r}")
        if extract not in EXTRACTIONS:
            raise ValueError(f"code reward extract must be one of {EXTRACTIONS}, got {extract!r}")
        if max_program_chars < 1 or cache_size < 0:
            raise ValueError("code reward max_program_chars must be >= 1 and cache_size >= 0")
        self.scoring = scoring
        self.extract = extract
        self.language = language
        self.max_program_chars = max_program_chars
        self.limits = SandboxLimits(
            wall_s=test_timeout_s,
            memory_mb=memory_mb,
            processes=processes,
            output_bytes=max_output_bytes,
            disk_mb=disk_mb,
        )
        self.sandbox = Sandbox(
            SandboxConfig(
                workers=workers,
                namespaces=namespaces,
                seccomp=seccomp,
                prewarm=prewarm,
                python=python,
                limits=self.limits,
            )
        )
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CodeOutcome] = OrderedDict()
        self._inflight: dict[str, asyncio.Future] = {}
        self._counts: Counter[str] = Counter()

    async def __call__(self, prompt: str, response: str, label: Any) -> float:
        return (await self.evaluate(prompt, response, label)).reward

    async def evaluate(self, prompt: str, response: str, label: Any) -> CodeOutcome:
        """The outcome of one response (RewardError for a bad label or a broken sandbox)."""
        problem = parse_problem(label)
        program = extract_program(response, self.extract, problem)
        if program is None:
            return self._count(CodeOutcome(0.0, "no_program"))
        limit = min(self.max_program_chars, problem.max_program_chars or self.max_program_chars)
        too_long = len(program) > limit
        if too_long and (self.scoring != "partial" or len(program) > self.max_program_chars):
            return self._count(CodeOutcome(0.0, "too_long"))
        outcome = await self._cached_run(program, problem)
        if too_long:  # partial scoring: credit scaled by how much too long it is
            outcome = CodeOutcome(outcome.reward * limit / len(program), "too_long", outcome.tests)
        return self._count(outcome)

    async def _cached_run(self, program: str, problem: CodeProblem) -> CodeOutcome:
        key = self._key(program, problem)
        if key in self._cache:
            self._cache.move_to_end(key)
            self._counts["cache_hits"] += 1
            return self._cache[key]
        if key in self._inflight:
            self._counts["cache_hits"] += 1
            return await asyncio.shield(self._inflight[key])
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            outcome = await self._run_tests(program, problem)
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, Exception) else RewardError("cancelled"))
            future.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            self._inflight.pop(key, None)
        future.set_result(outcome)
        self._remember(key, outcome)
        return outcome

    def _key(self, program: str, problem: CodeProblem) -> str:
        settings = f"{self.language}|{self.scoring}|{self.limits}"
        text = "\0".join((settings, problem.key(), program))
        return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()

    def _remember(self, key: str, outcome: CodeOutcome) -> None:
        if self.cache_size:
            self._cache[key] = outcome
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _count(self, outcome: CodeOutcome) -> CodeOutcome:
        self._counts[outcome.reason] += 1
        return outcome

    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call: code/<reason> per outcome, code/cache_hits."""
        counts, self._counts = self._counts, Counter()
        return {f"code/{name}": float(n) for name, n in sorted(counts.items())}

    # ------------------------------------------------------------------ running tests

    def _test_limits(self, problem: CodeProblem, test: TestCase) -> SandboxLimits:
        limits = self.limits
        if problem.time_limit_s is not None:
            limits = replace(limits, wall_s=float(problem.time_limit_s))
        if problem.memory_mb is not None:
            limits = replace(limits, memory_mb=int(problem.memory_mb))
        room = 2 * len(test.output.encode()) + 4096  # a right answer never hits the limit
        if room > limits.output_bytes:
            limits = replace(limits, output_bytes=room)
        return limits

    async def _run_test(self, program: str, problem: CodeProblem, test: TestCase) -> TestOutcome:
        run = await self.sandbox.run(
            program,
            test.input,
            language=self.language,
            spec=problem.spec(),
            limits=self._test_limits(problem, test),
        )
        if run.status == "sandbox_error":
            raise RewardError(f"sandbox: {run.error}")
        return self._judge(run, problem, test)

    def _judge(self, run: RunResult, problem: CodeProblem, test: TestCase) -> TestOutcome:
        if run.status != "ok":
            return TestOutcome(run.status, 0.0, run.wall_s, run.stderr)
        if self.scoring == "partial":
            credit = position_credit(run.stdout, test.output)
        elif problem.mode == "call":
            credit = float(call_result_matches(run.stdout, test.output))
        else:
            credit = float(stdout_matches(run.stdout, test.output))
        status = "passed" if credit == 1.0 else "wrong_answer"
        return TestOutcome(status, credit, run.wall_s, run.stderr)

    async def _run_tests(self, program: str, problem: CodeProblem) -> CodeOutcome:
        if self.scoring == "all":
            tests: list[TestOutcome] = []
            for test in problem.tests:  # in order, up to the first failure
                tests.append(await self._run_test(program, problem, test))
                if tests[-1].status != "passed":
                    return CodeOutcome(0.0, tests[-1].status, tests)
            return CodeOutcome(1.0, "passed", tests)
        runs = [self._run_test(program, problem, t) for t in problem.tests]
        tests = list(await asyncio.gather(*runs))
        reward = sum(t.credit for t in tests) / len(tests)
        failed = [t.status for t in tests if t.status != "passed"]
        return CodeOutcome(reward, failed[0] if failed else "passed", tests)

    async def aclose(self) -> None:
        await self.sandbox.aclose()
