"""RewardScorer: failures and timeouts give 0 and are counted; hangs cost about timeout_s."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from rewards.faulty_rewards import AsyncFaultyReward, FaultyReward, pid_reward

from gspo_megatron.rewards import RewardScorer, SyntheticReward

TIMEOUT = 0.5


def _score(scorer: RewardScorer, responses: list[str], labels: list[str]):
    return scorer.score(["p"] * len(labels), responses, labels)


def test_process_executor_hang_raise_bad_values_and_recovery():
    with RewardScorer(FaultyReward(), timeout_s=TIMEOUT, max_concurrency=4) as scorer:
        assert scorer.executor == "process"
        scorer.warmup()  # worker start-up is not part of the call timeout; keep it out of timing
        labels = ["a", "hang", "raise", "nan", "text", "b"]
        responses = ["a", "a", "a", "a", "a", "x"]
        start = time.perf_counter()
        batch = _score(scorer, responses, labels)
        elapsed = time.perf_counter() - start
        assert batch.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        assert batch.status == ["ok", "timeout", "error", "error", "error", "ok"]
        assert (batch.num_failures, batch.num_timeouts) == (3, 1)
        assert TIMEOUT <= elapsed < TIMEOUT + 1.5, elapsed
        assert any("ValueError" in e and e.startswith("item 2") for e in batch.errors)
        assert any("non-finite" in e for e in batch.errors)
        assert any("expected a float" in e for e in batch.errors)
        metrics = batch.metrics()
        assert metrics["reward/failures"] == 3.0 and metrics["reward/timeouts"] == 1.0
        assert metrics["reward/accuracy"] == pytest.approx(1 / 6)
        # the killed worker was replaced: the next batch scores normally
        again = _score(scorer, ["a", "b"], ["a", "a"])
        assert again.rewards == [1.0, 0.0] and again.status == ["ok", "ok"]


def test_process_executor_worker_crash_is_a_counted_failure():
    with RewardScorer(FaultyReward(), timeout_s=5, max_concurrency=1) as scorer:
        batch = _score(scorer, ["a", "a", "a"], ["a", "crash", "a"])
        assert batch.status == ["ok", "error", "ok"]
        assert "exited with code 3" in batch.errors[0]


def test_process_executor_runs_calls_in_other_processes_and_close_stops_them():
    scorer = RewardScorer(pid_reward, timeout_s=5, max_concurrency=2, executor="process")
    batch = _score(scorer, ["x"] * 4, ["x"] * 4)
    pids = {int(r) for r in batch.rewards}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    scorer.close()
    time.sleep(0.2)
    for pid in pids:  # children were reaped, so the pid no longer exists
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        _score(scorer, ["x"], ["x"])


def test_hung_batch_returns_within_about_one_timeout_at_full_concurrency():
    # 4 hung calls (sleeping and CPU-spinning) with 4 slots: one timeout, not four; the
    # spinning workers are killed, so nothing keeps burning CPU after the batch
    with RewardScorer(FaultyReward(), timeout_s=TIMEOUT, max_concurrency=4) as scorer:
        scorer.warmup()
        start = time.perf_counter()
        batch = _score(scorer, ["a"] * 4, ["hang", "spin", "hang", "spin"])
        elapsed = time.perf_counter() - start
    assert batch.status == ["timeout"] * 4 and batch.rewards == [0.0] * 4
    assert elapsed < 2 * TIMEOUT + 0.5, elapsed


def test_thread_executor_abandons_a_hung_call():
    with RewardScorer(FaultyReward(), timeout_s=TIMEOUT, max_concurrency=2, executor="thread") as s:
        start = time.perf_counter()
        batch = _score(s, ["a", "a", "a"], ["a", "hang", "raise"])
        elapsed = time.perf_counter() - start
        assert batch.status == ["ok", "timeout", "error"]
        assert batch.rewards == [1.0, 0.0, 0.0]
        assert elapsed < TIMEOUT + 1.0, elapsed
        assert s.abandoned_threads == 1


def test_async_reward_timeout_cancels_the_call():
    with RewardScorer(AsyncFaultyReward(), timeout_s=TIMEOUT, max_concurrency=8) as scorer:
        assert scorer.executor == "async"
        start = time.perf_counter()
        batch = _score(scorer, ["a", "a", "b", "a"], ["a", "hang", "raise", "b"])
        elapsed = time.perf_counter() - start
    assert batch.status == ["ok", "timeout", "error", "ok"]
    assert batch.rewards == [1.0, 0.0, 0.0, 0.0]
    assert elapsed < TIMEOUT + 1.0


def test_async_concurrency_is_bounded():
    in_flight = 0
    peak = 0

    async def slow(prompt, response, label):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return 1.0

    with RewardScorer(slow, timeout_s=5, max_concurrency=3) as scorer:
        batch = _score(scorer, ["a"] * 10, ["a"] * 10)
    assert batch.rewards == [1.0] * 10 and peak == 3


def test_ascore_from_a_running_event_loop():
    async def main():
        with RewardScorer(AsyncFaultyReward(), timeout_s=5) as scorer:
            return await scorer.ascore(["p", "p"], ["a", "b"], ["a", "a"])

    assert asyncio.run(main()).rewards == [1.0, 0.0]


def test_inline_safe_reward_runs_inline_and_errors_are_caught():
    def broken(prompt, response, label):
        raise KeyError("x")

    broken.inline_safe = True
    with RewardScorer(SyntheticReward(), timeout_s=1) as scorer:
        assert scorer.executor == "inline"
        assert _score(scorer, ["12", "1"], ["12", "12"]).rewards == [1.0, 0.5]
    with RewardScorer(broken, timeout_s=1) as scorer:
        batch = _score(scorer, ["a"], ["a"])
        assert batch.status == ["error"] and "KeyError" in batch.errors[0]


def test_executor_choice_and_config_errors():
    closure_value = 1.0

    def closure(prompt, response, label):  # local function: not picklable
        return closure_value

    with RewardScorer(closure, timeout_s=1) as scorer:
        assert scorer.executor == "thread"  # auto falls back, with a warning
        assert _score(scorer, ["a"], ["a"]).rewards == [1.0]
    with pytest.raises(ValueError, match="reward.executor=thread"):
        RewardScorer(closure, executor="process")
    with pytest.raises(ValueError, match="inline_safe"):
        RewardScorer(FaultyReward(), executor="inline")
    with pytest.raises(ValueError, match="async"):
        RewardScorer(AsyncFaultyReward(), executor="process")
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardScorer(pid_reward, timeout_s=0)
    with RewardScorer(SyntheticReward()) as scorer, pytest.raises(ValueError, match="equal"):
        scorer.score(["a", "b"], ["a"], ["a", "b"])
