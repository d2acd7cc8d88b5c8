"""Tool-call parsing in the Qwen3 format, the tool environment's error observations, the
built-in calculator and retrieval environments, the `env` config section and the chat-template
rendering of observations (token-in / token-out)."""

from __future__ import annotations

import pytest

from gspo_megatron.data.tokenizer import TOOL_TOKENS, build_char_tokenizer, load_tokenizer
from gspo_megatron.envs import EnvConfig, ToolEnvironment, parse_tool_calls
from gspo_megatron.envs.calculator import CalculatorEnv, calculate
from gspo_megatron.envs.chat import ChatFormat
from gspo_megatron.envs.retrieval import RetrievalEnv
from gspo_megatron.rewards.synthetic import lookup_code, make_task


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_parse_tool_calls():
    text = "let me see " + call("calculator", expression="1+2") + "\n" + call("search", query="x")
    calls = parse_tool_calls(text)
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None),
        ("search", {"query": "x"}, None),
    ]
    assert parse_tool_calls("the answer is 3") == []
    # arguments sent as a JSON string are accepted
    (c,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert c.arguments == {"a": 1} and c.error is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{bad</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", 'string "name"'),
        ('<tool_call>{"name": 3}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be'),
        ('<tool_call>{"name": "f"}', "without </tool_call>"),
    ],
)
def test_malformed_tool_calls(text, error):
    (c,) = parse_tool_calls(text)
    assert error in c.error


class Tools(ToolEnvironment):
    @staticmethod
    def _fail(x):
        raise ZeroDivisionError("no")

    tools = {"add": lambda a, b=0: a + b, "fail": _fail}


@pytest.mark.parametrize(
    ("turn", "observation"),
    [
        (call("add", a=2, b=3), "5"),
        (call("add", a=2), "2"),
        (call("nope"), "error: unknown tool 'nope'; tools: add, fail"),
        (call("add"), "error: tool add needs argument 'a'"),
        (call("add", a=1, c=2), "error: tool add takes no argument 'c'"),
        (call("fail", x=1), "error: tool fail failed: ZeroDivisionError: no"),
        ("<tool_call>{oops</tool_call>", "error: the tool call is not valid JSON"),
    ],
)
def test_tool_environment_observations(turn, observation):
    result = Tools().step(turn)
    assert not result.done and result.tool_calls == 1
    (text,) = result.observation
    assert text.startswith(observation)
    assert result.tool_errors == int(text.startswith("error"))


def test_a_turn_without_tool_call_is_the_final_answer():
    result = Tools().step("42")
    assert result.done and result.observation is None and result.tool_calls == 0


@pytest.mark.parametrize(
    ("expression", "value"), [("35+807", "842"), ("2*(3-10)", "-14"), (" -4 * -4 ", "16")]
)
def test_calculator(expression, value):
    assert calculate(expression) == value
    assert CalculatorEnv().step(call("calculator", expression=expression)).observation == [value]


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "2**10", "1/2", "x+1", "9" * 30 + "*" + "9" * 30, "1.5+1", "(1"],
)
def test_calculator_refuses_everything_but_integer_arithmetic(expression):
    (text,) = CalculatorEnv().step(call("calculator", expression=expression)).observation
    assert text.startswith("error:")


def test_retrieval_passage_holds_the_code_among_distractors():
    task = make_task("lookup")
    import random

    prompt, label = task.sample(random.Random(0))
    key = prompt.removeprefix("code:").removesuffix("=")
    assert label == lookup_code(key) and len(label) == 4
    env = RetrievalEnv(distractors=5)
    (passage,) = env.step(call("search", query=key)).observation
    assert f"the code of {key} is {label}." in passage
    assert passage.count("the code of") >= 4  # distractors (repeated keys collapse)
    assert len(passage) > 10 * len(label)  # long next to the answer
    (error,) = env.step(call("search", query="NOT A KEY!")).observation
    assert error.startswith("error: query must be")


def test_env_config_checks():
    EnvConfig().validate()
    EnvConfig(name="calculator").validate()
    EnvConfig(name="retrieval", kwargs={"distractors": 2}).validate()
    with pytest.raises(ValueError, match="unknown env.name='nope'"):
        EnvConfig(name="nope").validate()
    with pytest.raises(ValueError, match="env.kwargs do not fit environment 'calculator'"):
        EnvConfig(name="calculator", kwargs={"x": 1}).validate()
    with pytest.raises(ValueError, match="env.name='json:dumps' is not a subclass"):
        EnvConfig(name="json:dumps").validate()
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        EnvConfig(name="no_such_module:Env").validate()
    with pytest.raises(ValueError, match="env.max_turns"):
        EnvConfig(name="calculator", max_turns=0).validate()


def test_tool_tokenizer_keeps_tags_as_single_tokens():
    tok = load_tokenizer("char_tools")
    assert len(tok) == 67
    text = call("calculator", expression="35+807")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.convert_tokens_to_ids(TOOL_TOKENS[0]) == ids[0]
    # the plain character tokenizer's ids are unchanged
    plain = build_char_tokenizer()
    assert tok.encode("12+3=") == plain.encode("12+3=")


QWEN_LIKE = (
    "{% for m in messages %}{{ '<bos>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'tool' %}{{ '<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '<eos>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<bos>assistant\\n' }}{% endif %}"
)


def test_observation_ids_follow_the_turn_end_token():
    """Qwen3-style templates put a newline after the end-of-turn token: it belongs to the
    observation, since the model's turn ends with that token."""
    tok = build_char_tokenizer(chat_template=QWEN_LIKE, extra_tokens=TOOL_TOKENS)
    ids = ChatFormat(tok).message_ids(["12", "34"], "tool")
    assert tok.decode(ids, skip_special_tokens=False) == (
        "\n<bos>tool\n<tool_response>\n12\n</tool_response><eos>\n"
        "<bos>tool\n<tool_response>\n34\n</tool_response><eos>\n<bos>assistant\n"
    )
    assert ChatFormat(tok).user_ids("1+2=") == tok.encode(
        "<bos>user\n1+2=<eos>\n<bos>assistant\n", add_special_tokens=False
    )


def test_template_without_turn_end_is_refused_and_history_rewrites_are_not_read():
    no_end = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = build_char_tokenizer(chat_template=no_end)
    with pytest.raises(ValueError, match="does not end an assistant turn with the end token"):
        ChatFormat(tok).message_ids(["1"], "tool")
    # earlier messages rendered differently once one follows (the count up front): the
    # observation is what follows the turn's end token all the same
    rewrites = no_end.replace("{% endfor %}", "{{ eos_token }}{% endfor %}")
    tok = build_char_tokenizer(chat_template=rewrites)
    assert tok.decode(ChatFormat(tok).message_ids(["12"], "tool")) == "12<eos>"
    with pytest.raises(ValueError, match="need a tokenizer with a chat template"):
        ChatFormat(build_char_tokenizer(chat_template=None))
