"""Qwen3's chat format, token for token: observations (tool responses, user replies) and tool
calls rendered as Qwen3's own chat template renders them.

`qwen3_chat_template.jinja` is Qwen3's template (Qwen/Qwen3-*'s tokenizer_config.json), as TRL
ships it for identity comparison (trl/chat_templates/qwen3.jinja, "Original Qwen3 chat
template"; TRL checks its copies against the Hub weekly). The tokenizer here has Qwen3's special
tokens (<|im_start|>, <|im_end|> as eos, <|endoftext|> as pad, the tool and think tags, each one
token) over single characters; a real Qwen3 tokenizer is used too when one is on this machine
(GSPO_QWEN3_TOKENIZER, or Qwen/Qwen3-0.6B in the Hugging Face cache), else that test skips.
"""

from __future__ import annotations

import importlib.util
import json
import os
import string
from pathlib import Path

import pytest

from gspo_megatron.envs.chat import ChatFormat
from gspo_megatron.envs.tools import parse_tool_calls, qwen3_tool_call

TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip


def qwen3_layout_tokenizer():
    """Characters plus Qwen3's special tokens, eos <|im_end|>, pad <|endoftext|>, Qwen3's
    template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate((*chars, "<unk>", *QWEN3_SPECIALS))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(list(QWEN3_SPECIALS))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>",
    )  # fmt: skip
    tok.chat_template = TEMPLATE
    return tok


def real_qwen3_tokenizer():
    from transformers import AutoTokenizer

    path = os.environ.get("GSPO_QWEN3_TOKENIZER", "Qwen/Qwen3-0.6B")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - not on this machine
        pytest.skip(
            f"no Qwen3 tokenizer available offline ({path}: {type(e).__name__}); set "
            "GSPO_QWEN3_TOKENIZER to a local Qwen3 tokenizer directory to run this test"
        )


TOKENIZERS = [
    pytest.param(qwen3_layout_tokenizer, id="qwen3_layout"),
    pytest.param(real_qwen3_tokenizer, id="real_qwen3"),
]


CALL = qwen3_tool_call("calculator", {"expression": "35+807"})
REASONED = "<think>\nadd them\n</think>\n\n" + CALL  # a turn with its reasoning


def render(tok, messages, generation_prompt):
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def test_the_template_is_qwen3s_as_trl_ships_it():
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("trl is not installed: the template copy cannot be compared with its")
    shipped = Path(next(iter(spec.submodule_search_locations))) / "chat_templates/qwen3.jinja"
    assert shipped.read_text() == TEMPLATE


@pytest.mark.parametrize("make", TOKENIZERS)
def test_tool_responses_as_the_template_renders_them(make):
    tok = make()
    chat = ChatFormat(tok)
    ids = chat.message_ids(["842", "error: unknown tool 'x'; tools: calculator"], "tool")
    # consecutive tool messages: one user turn of <tool_response> blocks; the "\n" after the
    # model's <|im_end|> opens the observation
    assert tok.decode(ids, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n842\n</tool_response>\n<tool_response>\n"
        "error: unknown tool 'x'; tools: calculator\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    user = chat.message_ids(["higher"], "user")
    assert tok.decode(user, skip_special_tokens=False) == (
        "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(chat.user_ids("35+807="), skip_special_tokens=False) == (
        "<|im_start|>user\n35+807=<|im_end|>\n<|im_start|>assistant\n"
    )
    for token in ("<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>"):
        assert tok.convert_tokens_to_ids(token) in ids  # special tokens, one id each


@pytest.mark.parametrize("make", TOKENIZERS)
def test_an_episode_as_tokens_is_the_templates_conversation(make):
    """Initial context + the model's turns (ending with <|im_end|>) + observations, appended
    token by token, equal the template's rendering of the whole conversation when the turns
    carry their reasoning (as the template renders turns after the last user query)."""
    tok = make()
    chat = ChatFormat(tok)
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    episode = chat.user_ids("35+807=") + encode(REASONED) + end
    episode += chat.message_ids(["842"], "tool")
    episode += encode("<think>\ncopy it\n</think>\n\n842") + end
    conversation = [
        {"role": "user", "content": "35+807="},
        {"role": "assistant", "content": REASONED},
        {"role": "tool", "content": "842"},
        {"role": "assistant", "content": "<think>\ncopy it\n</think>\n\n842"},
    ]
    # the template closes the last turn with "\n" too: the next observation's first token
    whole = render(tok, conversation, False)
    assert whole.endswith("<|im_end|>\n")
    assert tok.decode(episode, skip_special_tokens=False) == whole[:-1]
    assert episode == encode(whole[:-1])


@pytest.mark.parametrize("make", TOKENIZERS)
def test_an_earlier_turn_the_template_renders_differently_is_kept_as_sampled(make):
    """Qwen3's template drops an empty think block from an assistant turn once a message
    follows it (not prefix-preserving): the observation is still the template's, and the
    trajectory keeps the turn as the model sampled it."""
    tok = make()
    sampled = "<think>\n\n</think>\n\n" + CALL
    alone = render(
        tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": sampled}], False
    )
    followed = render(
        tok,
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": sampled},
         {"role": "tool", "content": "842"}],
        True,
    )  # fmt: skip
    assert not followed.startswith(alone)  # the template rewrites the turn
    observation = ChatFormat(tok).observation_text(["842"], "tool")
    assert followed.endswith("<|im_end|>" + observation)


@pytest.mark.parametrize("make", TOKENIZERS)
def test_tool_calls_as_the_template_renders_them(make):
    tok = make()
    arguments = {"expression": "35+807", "note": "naïve", "digits": [3, 5]}
    text = render(
        tok,
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": arguments}},
                {"type": "function", "function": {"name": "search", "arguments": {"query": "k"}}},
            ]},
        ],
        False,
    )  # fmt: skip
    expected = (
        qwen3_tool_call("calculator", arguments) + "\n" + qwen3_tool_call("search", {"query": "k"})
    )
    # (as the last message, the template opens the turn with an empty think block)
    assert text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n" + expected + "<|im_end|>\n"
    )
    calls = parse_tool_calls(expected)
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("calculator", arguments, None),
        ("search", {"query": "k"}, None),
    ]
    assert json.loads(CALL.split("\n")[1])["arguments"] == {"expression": "35+807"}
