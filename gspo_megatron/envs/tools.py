"""Tool calling in the Qwen3 chat format.

A model turn calls tools with one or more blocks

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "35+807"}}
    </tool_call>

(Qwen3's and Hermes' format; `qwen3_tool_call` writes one exactly as Qwen3's chat template
renders an assistant message's tool call, and successive calls are separated by "\n"); each
result goes back as a `tool` message, which Qwen3's chat template renders inside
<tool_response> ... </tool_response>, the consecutive ones of a turn in one user message
(envs/chat.py renders them with the tokenizer's own template). The parser also takes compact
JSON without the newlines (the built-in environments' demonstrations write it for the character
tokenizer). A turn without a tool call is the episode's final answer.

`ToolEnvironment` is an `Environment` over a set of tools (plain functions; their signatures say
which arguments are required). A call that cannot run - bad JSON, an unknown tool, a missing or
unexpected argument, a tool that raises - gets an error observation instead ("error: ..."),
counted in `StepResult.tool_errors`; with env.on_tool_error=end the episode ends there instead.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gspo_megatron.envs.base import Environment, StepResult

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


def qwen3_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One tool call as Qwen3's chat template renders it: the tags on lines of their own and
    the arguments as its `tojson` filter writes them (json.dumps: ", " and ": ", keys in the
    given order, non-ASCII kept)."""
    body = json.dumps(dict(arguments), ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {body}}}\n{TOOL_CALL_CLOSE}'


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and arguments, or why it could not be parsed."""

    name: str = ""
    arguments: Mapping[str, Any] | None = None
    error: str | None = None


def parse_tool_calls(turn: str) -> list[ToolCall]:
    """The tool calls of a model turn, in order; malformed ones carry an `error`. An opening tag
    without its closing tag is one malformed call."""
    calls = [_parse_one(body) for body in _TOOL_CALL.findall(turn)]
    rest = _TOOL_CALL.sub("", turn)
    if TOOL_CALL_OPEN in rest:
        calls.append(ToolCall(error=f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='a tool call must be a JSON object with a string "name"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], error='"arguments" must be a JSON object')
    return ToolCall(name=call["name"], arguments=arguments)


class ToolError(Exception):
    """A tool's own refusal of its arguments; the message is the error observation."""


class ToolEnvironment(Environment):
    """An environment whose model turns either call tools or give the final answer.

    Subclasses set `tools` (name -> function taking keyword arguments and returning text) and
    may override `answer` (the reward of the final answer; default 0: the reward section scores
    it) and `reset`.
    """

    tools: ClassVar[Mapping[str, Callable[..., Any]]] = {}

    def step(self, turn: str) -> StepResult:
        calls = parse_tool_calls(turn)
        if not calls:
            return StepResult(reward=self.answer(turn), done=True)
        results = [self.run_call(call) for call in calls]
        errors = sum(1 for ok, _ in results if not ok)
        return StepResult(
            observation=[text for _, text in results], tool_calls=len(calls), tool_errors=errors
        )

    def answer(self, turn: str) -> float:
        return 0.0

    def run_call(self, call: ToolCall) -> tuple[bool, str]:
        """(ran, observation text) for one call."""
        if call.error is not None:
            return False, f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return (
                False,
                f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}",
            )
        problem = _argument_problem(call.name, tool, call.arguments or {})
        if problem:
            return False, f"error: {problem}"
        try:
            return True, str(tool(**call.arguments))
        except ToolError as e:
            return False, f"error: {e}"
        except Exception as e:  # noqa: BLE001 - a failing tool is an observation, not a crash
            return False, f"error: tool {call.name} failed: {type(e).__name__}: {e}"


def _argument_problem(name: str, tool: Callable[..., Any], arguments: Mapping[str, Any]) -> str:
    parameters = inspect.signature(tool).parameters
    required = [
        p.name for p in parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]  # fmt: skip
    missing = [a for a in required if a not in arguments]
    if missing:
        return f"tool {name} needs argument {missing[0]!r}"
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unexpected = [a for a in arguments if a not in parameters]
    if unexpected and not takes_any:
        return f"tool {name} takes no argument {unexpected[0]!r}"
    return ""
