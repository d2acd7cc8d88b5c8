"""Code problems from labels, programs from responses, and output comparison.

A label (the `label` field of a prompt file, a dict or its JSON text) gives the tests:

    {"tests": [{"input": "1 2\\n", "output": "3\\n"}, ...]}                  stdin/stdout
    {"tests": [{"input": "[1, 2]\\n3", "output": "[1, 2, 3]", "testtype": "functional"}],
     "fn_name": "append"}                                                      function call
    {"inputs": [...], "outputs": [...], "fn_name": null}                       APPS / TACO style
    {"input_output": "<the same as JSON text>"}

Optional keys: "time_limit_s" and "memory_mb" (this problem's limits, e.g. CodeForces'),
"max_program_chars" (a longer program scores 0), "mode": "expression" (the response itself is
one Python expression whose printed value is the output: the synthetic `expr` task).

Function-call tests (LiveCodeBench's "functional"): each input line is one JSON argument, the
output is the JSON of the return value, compared as values (a tuple counts as a list).
Stdin/stdout tests are compared as LiveCodeBench does: surrounding whitespace of the whole
output and of each line ignored, the same number of lines, and each line equal as text or as
a sequence of numbers (Decimal, so 0.50 == 0.5 and large integers stay exact).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from gspo_megatron.rewards.base import RewardError

Mode = Literal["script", "call", "expression"]
EXTRACTIONS = ("fenced", "raw")
_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
_PYTHON_TAGS = frozenset({"", "python", "py", "python3"})


@dataclass(frozen=True)
class TestCase:
    input: str
    output: str


@dataclass(frozen=True)
class CodeProblem:
    tests: tuple[TestCase, ...]
    mode: Mode = "script"
    fn_name: str | None = None
    time_limit_s: float | None = None
    memory_mb: int | None = None
    max_program_chars: int | None = None

    def spec(self) -> dict[str, Any]:
        """What the sandbox's harness needs to run a program of this problem."""
        return {"mode": self.mode, "fn_name": self.fn_name}

    def key(self) -> str:
        """Everything that decides a program's outcome, for the cache."""
        return json.dumps(
            [self.mode, self.fn_name, self.time_limit_s, self.memory_mb, self.max_program_chars,
             [(t.input, t.output) for t in self.tests]]
        )  # fmt: skip


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # some sets store an input as its lines
    raise RewardError(f"code label: {where} must be text, got {type(value).__name__}")


def parse_problem(label: Any) -> CodeProblem:
    """The problem a label describes (RewardError with what is wrong)."""
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as exc:
            raise RewardError(f"code label is not JSON ({exc.msg}): {label[:80]!r}") from None
    if not isinstance(label, dict):
        raise RewardError(
            f"code label must be an object with tests, got {type(label).__name__}; see "
            "docs/SANDBOX.md for the formats"
        )
    if "input_output" in label:
        inner = label["input_output"]
        inner = json.loads(inner) if isinstance(inner, str) else inner
        return parse_problem({**{k: v for k, v in label.items() if k != "input_output"}, **inner})
    fn_name = label.get("fn_name") or (label.get("metadata") or {}).get("func_name")
    if "tests" in label:
        raw = label["tests"]
        if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
            raise RewardError("code label: tests must be a list of {input, output} objects")
        tests = [(t.get("input"), t.get("output"), t.get("testtype")) for t in raw]
    elif "inputs" in label and "outputs" in label:
        if len(label["inputs"]) != len(label["outputs"]):
            raise RewardError("code label: inputs and outputs differ in length")
        tests = [(i, o, None) for i, o in zip(label["inputs"], label["outputs"], strict=True)]
    else:
        raise RewardError(f"code label has no tests (keys: {sorted(label)})")
    if not tests:
        raise RewardError("code label has an empty test list")
    functional = {kind == "functional" for _, _, kind in tests}
    mode: Mode = label.get("mode") or ("call" if fn_name or True in functional else "script")
    if mode not in ("script", "call", "expression"):
        raise RewardError(f"code label: unknown mode {mode!r}")
    if mode == "call" and not fn_name:
        raise RewardError("code label: function-call tests need fn_name (or metadata.func_name)")
    cases = tuple(
        TestCase(_text(i, f"test {n} input"), _text(o, f"test {n} output"))
        for n, (i, o, _) in enumerate(tests)
    )
    return CodeProblem(
        cases,
        mode=mode,
        fn_name=fn_name if mode == "call" else None,
        time_limit_s=label.get("time_limit_s"),
        memory_mb=label.get("memory_mb"),
        max_program_chars=label.get("max_program_chars"),
    )


def extract_program(response: str, extract: str, problem: CodeProblem) -> str | None:
    """The program a response gives, or None when it gives none.

    fenced: the last ``` block tagged python, py, python3 or untagged, after the last
    </think> (a reasoning model's final answer); raw: the response as it is. A problem in
    expression mode takes the response as it is whatever `extract` says.
    """
    if problem.mode == "expression" or extract == "raw":
        return response if response.strip() else None
    text = response.rsplit("</think>", 1)[-1]
    blocks = [code for tag, code in _FENCE.findall(text) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks and blocks[-1].strip() else None


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _numbers(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(tok) for tok in line.split()]
    except InvalidOperation:
        return None


def stdout_matches(actual: str, expected: str) -> bool:
    """LiveCodeBench's comparison of a program's output with the expected one."""
    got, want = _stripped_lines(actual), _stripped_lines(expected)
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        na, nb = _numbers(a), _numbers(b)
        if na is None or nb is None or na != nb:
            return False
    return True


def call_result_matches(actual: str, expected: str) -> bool:
    """A function's printed JSON result against the expected JSON value."""
    try:
        got = json.loads(actual.strip().rsplit("\n", 1)[-1])
        want = json.loads(expected)
    except (json.JSONDecodeError, IndexError):
        return False
    return got == want


def position_credit(actual: str, expected: str) -> float:
    """Fraction of characters that agree position by position, over the longer length (the
    synthetic tasks' partial credit, applied to a program's output as printed: the newline
    after a value of the right length earns its position, a signal for the right length)."""
    longest = max(len(actual), len(expected))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(actual, expected, strict=False)) / longest
