"""A calculator tool on the synthetic `add` task (data.task=add): the policy may call

    <tool_call>{"name": "calculator", "arguments": {"expression": "35+807"}}</tool_call>

and read the result in the tool response before it answers. The reward section scores the final
answer (reward=synthetic). With operands of several digits the sum is hard for a small model to
compute, easy to copy from the tool's response.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, ClassVar

from gspo_megatron.envs.tools import ToolEnvironment, ToolError

MAX_DIGITS = 40  # operands and results; bounds the work of one call
_TOKEN = re.compile(r"\s*(\d+|[-+*()])")


def calculate(expression: str) -> str:
    """The value of an integer expression with + - * and parentheses (no other syntax)."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ToolError("expression must be a string of at most 200 characters")
    tokens, pos = [], 0
    while pos < len(expression.rstrip()):
        match = _TOKEN.match(expression, pos)
        if match is None:
            raise ToolError("only integers, + - * and parentheses are allowed")
        tokens.append(match.group(1))
        pos = match.end()
    parser = _Parser(tokens)
    value = parser.sum()
    if parser.pos != len(tokens):
        raise ToolError(f"cannot parse expression {expression!r}")
    return str(value)


class _Parser:
    """sum := product (("+" | "-") product)*; product := factor ("*" factor)*;
    factor := integer | "-" factor | "(" sum ")"."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos = tokens, 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ToolError("the expression ends too early")
        self.pos += 1
        return token

    def sum(self) -> int:
        value = self.product()
        while self._peek() in ("+", "-"):
            sign = 1 if self._take() == "+" else -1
            value = _bounded(value + sign * self.product())
        return value

    def product(self) -> int:
        value = self.factor()
        while self._peek() == "*":
            self._take()
            value = _bounded(value * self.factor())
        return value

    def factor(self) -> int:
        token = self._take()
        if token == "-":
            return -self.factor()
        if token == "(":
            value = self.sum()
            if self._take() != ")":
                raise ToolError("unbalanced parentheses")
            return value
        if token.isdigit():
            return _bounded(int(token))
        raise ToolError(f"unexpected {token!r}")


def _bounded(value: int) -> int:
    if len(str(abs(value))) > MAX_DIGITS:
        raise ToolError(f"numbers are limited to {MAX_DIGITS} digits")
    return value


def tool_call(expression: str) -> str:
    """The calculator call of the demonstrations (compact JSON, as the policy learns to write)."""
    arguments = json.dumps({"expression": expression}, separators=(",", ":"))
    return f'<tool_call>{{"name":"calculator","arguments":{arguments}}}</tool_call>'


class CalculatorEnv(ToolEnvironment):
    inline_safe = True
    tools: ClassVar = {"calculator": calculate}

    # A demonstrated call writes each operand digit one too high with this probability.
    demonstration_slip: ClassVar[float] = 0.6

    @classmethod
    def demonstration(cls, prompt: str, label: Any, rng: random.Random) -> list[str]:
        """A sloppy demonstrator: half of the time it calls the calculator on the prompt's
        operands, writing each digit one too high (9 -> 0) with probability
        `demonstration_slip`, and answers with the result; otherwise it answers a random number
        of the answer's size. A policy warm-started on it knows how to call the tool and to read
        its answer, and has the demonstrator's habit: its most likely call is wrong, so it
        solves almost nothing, greedy or sampled. RL has to make it copy the operands exactly."""
        operands = prompt.rstrip("=").split("+")
        if rng.random() < 0.5:
            expression = "+".join(
                "".join(str((int(d) + 1) % 10) if rng.random() < cls.demonstration_slip else d
                        for d in operand)
                for operand in operands
            )  # fmt: skip
            return [tool_call(expression), calculate(expression)]
        size = len(str(label))
        return [str(rng.randrange(10 ** (size - 1), 10**size))]
