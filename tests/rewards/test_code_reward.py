"""The code reward on LiveCodeBench-format problems (tests/rewards/data/livecodebench_sample.jsonl,
written for these tests: stdin/stdout and function-call problems, private tests in
LiveCodeBench's pickled encoding): the reader, its refusal of pickled code, scoring of
known-correct, known-wrong and partially correct programs, the reasons reaching the scorer's
metrics, and the HTTP sandbox service behind reward=remote."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

import pytest
from sandbox_host import requires_sandbox

from gspo_megatron.network import free_port
from gspo_megatron.rewards import RemoteRewardError, RewardScorer, build_reward
from gspo_megatron.rewards.code import CodeReward
from gspo_megatron.rewards.code.livecodebench import main as lcb_main
from gspo_megatron.rewards.code.livecodebench import read_rows

SAMPLE = Path(__file__).with_name("data") / "livecodebench_sample.jsonl"

# Per problem: a right program, a wrong one, and one that passes some of the tests but not
# all (with the fraction it passes).
PROGRAMS = {
    "test_sum": {
        "right": "n = int(input())\nprint(sum(map(int, input().split())))\n",
        "wrong": "print(input())\n",
        "partial": ("n = int(input())\nprint(sum(abs(int(x)) for x in input().split()))\n", 2 / 3),
    },
    "test_sorted_mean": {
        # prints 2.0 where 2.00 is expected: equal as numbers, as LiveCodeBench compares
        "right": "n = int(input())\nxs = sorted(map(int, input().split()))\n"
        "print(*xs, sep='\\n')\nprint(sum(xs) / n)\n",
        "wrong": "n = int(input())\nxs = sorted(map(int, input().split()))\n"
        "print(*xs)\nprint(sum(xs) / n)\n",  # one line where each number needs its own
        "partial": ("n = int(input())\nxs = sorted(map(int, input().split()))\n"
                    "print(*xs, sep='\\n')\nprint(f'{sum(xs) / n:.2f}' if n < 4 else 0)\n", 2 / 3),
    },
    "test_two_sum": {
        "right": "class Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n                return [seen[target - x], i]\n"
        "            seen[x] = i\n",
        "wrong": "class Solution:\n    def twoSum(self, nums, target):\n        return (0, 0)\n",
        "partial": ("class Solution:\n    def twoSum(self, nums, target):\n"
                    "        print('debugging', nums)\n        return (0, 1)\n", 2 / 3),
    },
    "test_palindrome": {  # a top-level function where LiveCodeBench has a method: also fine
        "right": "def isPalindrome(s):\n    return s == s[::-1]\n",
        "wrong": "def isPalindrome(s):\n    return 'true'\n",
        "partial": ("def isPalindrome(s):\n    return len(s) > 0 and s == s[::-1]\n", 2 / 3),
    },
}  # fmt: skip


def response(program: str) -> str:
    """A reasoning model's answer: a draft inside <think>, then the final fenced program."""
    draft = "<think>\n```python\nprint('draft')\n```\n</think>\n"
    return f"{draft}Here it is:\n```python\n{program}```\n"


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    out = tmp_path_factory.mktemp("lcb") / "problems.jsonl"
    lcb_main([str(SAMPLE), str(out)])
    return {r["question_id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_the_reader_turns_rows_into_prompts_with_every_test(problems):
    assert list(problems) == list(PROGRAMS)
    two_sum = problems["test_two_sum"]
    assert two_sum["label"]["fn_name"] == "twoSum"
    assert [t["input"] for t in two_sum["label"]["tests"]] == [
        "[2, 7, 11, 15]\n9", "[3, 2, 4]\n6", "[3, 3]\n6"  # the private test, unpickled
    ]  # fmt: skip
    assert "def twoSum(self, nums: List[int], target: int)" in two_sum["prompt"]
    stdin_prompt = problems["test_sum"]["prompt"]
    assert "```python" in stdin_prompt and "stdin" in stdin_prompt
    assert len(problems["test_sum"]["label"]["tests"]) == 3
    assert (two_sum["platform"], two_sum["difficulty"]) == ("leetcode", "medium")


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_loading_a_pickled_payload_never_runs_it(tmp_path):
    marker = tmp_path / "the-pickle-ran"
    payload = pickle.dumps([{"input": "1\n", "output": "1\n"}, _Boom(marker)])
    pickle.loads(payload)  # loaded naively, this payload runs code: the test's premise
    assert marker.exists()
    marker.unlink()
    row = json.loads(SAMPLE.read_text().splitlines()[0])
    row["private_test_cases"] = base64.b64encode(zlib.compress(payload)).decode()
    bad = tmp_path / "evil.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(
        ValueError, match=r"evil.jsonl:1: private_test_cases: .*refusing to load builtins.exec"
    ):  # noqa: E501
        read_rows(str(bad))
    with pytest.raises(SystemExit, match="livecodebench: .*evil.jsonl:1"):
        lcb_main([str(bad), str(tmp_path / "out.jsonl")])
    assert not marker.exists() and not (tmp_path / "out.jsonl").exists()


def test_bad_rows_are_named(tmp_path):
    cases = {
        "{not json": "not JSON",
        json.dumps({"question_content": "x"}): "not a LiveCodeBench row",
        json.dumps({"question_content": "x", "public_test_cases": "[]"}): "empty test list",
    }
    for line, message in cases.items():
        path = tmp_path / "rows.jsonl"
        path.write_text("\n" + line + "\n")
        with pytest.raises(ValueError, match=f"rows.jsonl:2: .*{message}"):
            read_rows(str(path))


@requires_sandbox
@pytest.mark.parametrize("scoring", ["all", "fraction"])
def test_known_programs_score_as_they_should(problems, scoring):
    reward = CodeReward(scoring=scoring, test_timeout_s=10, memory_mb=256, workers=2,
                        cache_size=0)  # fmt: skip

    async def score_all():
        calls, expected = [], []
        for qid, programs in PROGRAMS.items():
            record = problems[qid]
            partial, fraction = programs["partial"]
            partial_reward = fraction if scoring == "fraction" else 0.0
            for program, want in ((programs["right"], 1.0), (programs["wrong"], 0.0),
                                  (partial, partial_reward)):  # fmt: skip
                calls.append(reward.evaluate(record["prompt"], response(program), record["label"]))
                expected.append((qid, want))
        return expected, await asyncio.gather(*calls)

    expected, outcomes = asyncio.run(score_all())
    got = [(qid, round(out.reward, 6)) for (qid, _), out in zip(expected, outcomes, strict=True)]
    assert got == [(qid, round(want, 6)) for qid, want in expected]
    reasons = {out.reason for out in outcomes}
    assert reasons == {"passed", "wrong_answer"}
    asyncio.run(reward.aclose())


@requires_sandbox
def test_reasons_reach_the_scorers_metrics(problems):
    record = problems["test_sum"]
    reward = CodeReward(scoring="all", test_timeout_s=2, memory_mb=256, workers=2)
    responses = [response(PROGRAMS["test_sum"]["right"]), response("while True: pass\n"),
                 response("raise ValueError\n"), "no code here",
                 response(PROGRAMS["test_sum"]["right"])]  # fmt: skip
    with RewardScorer(reward, timeout_s=60, max_concurrency=4) as scorer:
        batch = scorer.score([record["prompt"]] * 5, responses, [record["label"]] * 5)
    metrics = batch.metrics(prefix="reward/")
    assert batch.rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert {k: v for k, v in metrics.items() if k.startswith("reward/code/")} == {
        "reward/code/passed": 2.0,
        "reward/code/timeout": 1.0,
        "reward/code/runtime_error": 1.0,
        "reward/code/no_program": 1.0,
        "reward/code/cache_hits": 1.0,  # the second right program: the same outcome
    }


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@requires_sandbox
def test_the_sandbox_service_behind_reward_remote(problems, tmp_path):
    port = free_port()
    log = tmp_path / "service.log"
    service = subprocess.Popen(
        [sys.executable, "-m", "gspo_megatron.rewards.code.service", "--port", str(port),
         "--scoring", "fraction", "--workers", "2", "--test-timeout-s", "5"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = _get(f"{base}/health")
                break
            except OSError:
                assert service.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the service never answered"
                time.sleep(0.2)
        assert health == {"layers": ["rlimits", "namespaces", "unprivileged", "seccomp"],
                          "workers": 2}  # fmt: skip
        remote = build_reward("remote", url=f"{base}/score", max_retries=0,
                              request_timeout_s=60)  # fmt: skip
        prompts, responses, labels, expected = [], [], [], []
        for qid, programs in PROGRAMS.items():
            record = problems[qid]
            partial, fraction = programs["partial"]
            for program, want in ((programs["right"], 1.0), (programs["wrong"], 0.0),
                                  (partial, fraction)):  # fmt: skip
                prompts.append(record["prompt"])
                responses.append(response(program))
                labels.append(record["label"])
                expected.append(want)
        with RewardScorer(remote, timeout_s=120, max_concurrency=4) as scorer:
            batch = scorer.score(prompts, responses, labels)
        assert batch.rewards == pytest.approx(expected) and batch.num_failures == 0

        # the protocol itself: /score's outcome, /run's result, a bad label answered 400
        body = json.dumps({"prompt": "", "response": response("print(6)\n"),
                           "label": problems["test_sum"]["label"]}).encode()  # fmt: skip
        json_type = {"Content-Type": "application/json"}
        request = urllib.request.Request(f"{base}/score", body, json_type)
        with urllib.request.urlopen(request, timeout=60) as resp:
            scored = json.loads(resp.read())
        assert scored["reward"] == pytest.approx(1 / 3) and scored["reason"] == "wrong_answer"
        assert [t["status"] for t in scored["tests"]] == ["passed", "wrong_answer", "wrong_answer"]
        run = json.dumps({"program": "print(input()[::-1])", "stdin": "abc\n"}).encode()
        request = urllib.request.Request(f"{base}/run", run, json_type)
        with urllib.request.urlopen(request, timeout=60) as resp:
            result = json.loads(resp.read())
        assert (result["status"], result["stdout"]) == ("ok", "cba\n")

        async def bad_label():
            try:
                return await remote("", response("print(1)\n"), {"cases": []})
            finally:
                await remote.aclose()

        with pytest.raises(RemoteRewardError, match="HTTP 400.*code label has no tests"):
            asyncio.run(bad_label())
    finally:
        service.terminate()
        service.wait(30)
