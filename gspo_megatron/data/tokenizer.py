"""A character-level tokenizer built locally (no download) for the synthetic tasks and CPU demos.

    tok = build_char_tokenizer()          # transformers.PreTrainedTokenizerFast, 48 tokens
    tok("rev:1234=").input_ids            # [1, 31, 18, 35, 44, 5, 6, 7, 8, 43]  (<bos> first)
    tok.eos_token_id                      # 2: the stop token for generation
    tok.save_pretrained(path)             # travels with checkpoints and HF conversion
    load_tokenizer(path)                  # AutoTokenizer.from_pretrained(path) gives it back

Vocabulary: ids 0-3 are <pad>, <bos>, <eos>, <unk>; then one token per character of `chars`
(digits, lowercase letters and a few symbols by default). Characters outside it encode as <unk>.
Encoding with special tokens prepends <bos>; decoding joins characters with nothing in between.
The chat template concatenates message contents after <bos> and ends assistant turns with <eos>,
ignoring roles: enough for chat-formatted data sets on a tiny model, not a real chat format.

"char_tools" (`build_tool_char_tokenizer`, 67 tokens: model.vocab_size 80) adds the characters
of JSON tool calls, the Qwen3 tool tags <tool_call> </tool_call> <tool_response>
</tool_response> and a few merges of the built-in tools' compact JSON calls as single tokens;
its chat template wraps `tool` messages in <tool_response> tags, for the multi-turn
environments (gspo_megatron/envs).

"char_expr" (16 tokens: model.vocab_size 16) has only the digits, "+" and "=": the synthetic
code task's (expr, `+experiment=code_cpu`), where a random policy's responses must often be
valid Python expressions for the code reward to give it a signal.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# 4 specials + 44 characters = 48 tokens: conf/model/tiny_*.yaml use vocab_size 48.
DEFAULT_CHARS = string.digits + string.ascii_lowercase + " +-=:,.\n"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Merges of the tool calls' JSON, as a subword tokenizer has them: a call to a built-in tool is
# 7 tokens around its argument instead of ~50 characters.
TOOL_WORDS = (
    '{"name":"',
    '","arguments":{"',
    '":"',
    '"}}',
    "calculator",
    "expression",
    "search",
    "query",
)
TOOL_CHARS = DEFAULT_CHARS + '{}"*()_'
# The synthetic code task's (expr): 4 specials + 12 characters = 16 tokens, model.vocab_size 16.
EXPR_CHARS = string.digits + "+="
CHAR_TOKENIZER_NAME = "char"
TOOL_CHAR_TOKENIZER_NAME = "char_tools"
EXPR_CHAR_TOKENIZER_NAME = "char_expr"
CHAR_TOKENIZER_NAMES = (CHAR_TOKENIZER_NAME, TOOL_CHAR_TOKENIZER_NAME, EXPR_CHAR_TOKENIZER_NAME)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<tool_response>{{ message['content'] }}</tool_response>"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_char_tokenizer(
    chars: str = DEFAULT_CHARS,
    chat_template: str | None = CHAT_TEMPLATE,
    model_max_length: int = 128,
    extra_tokens: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `chars` plus <pad>, <bos>, <eos>, <unk> (and
    `extra_tokens`, each one token, after the characters)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(chars)) != len(chars):
        dupes = sorted({c for c in chars if chars.count(c) > 1})
        raise ValueError(f"char tokenizer: duplicate characters {dupes!r}")
    if not chars:
        raise ValueError("char tokenizer: `chars` is empty")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars, *extra_tokens))}
    # BPE without merges = one token per character; unknown characters -> <unk>.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens([*SPECIAL_TOKENS, *extra_tokens])
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=model_max_length,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_tool_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer with tool-call characters and tags (see the module docstring)."""
    return build_char_tokenizer(
        TOOL_CHARS, TOOL_CHAT_TEMPLATE, extra_tokens=TOOL_TOKENS + TOOL_WORDS
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """ "char" / "char_tools" / "char_expr" build the character tokenizers; anything else goes
    to AutoTokenizer."""
    if name_or_path == CHAR_TOKENIZER_NAME:
        return build_char_tokenizer()
    if name_or_path == TOOL_CHAR_TOKENIZER_NAME:
        return build_tool_char_tokenizer()
    if name_or_path == EXPR_CHAR_TOKENIZER_NAME:
        return build_char_tokenizer(EXPR_CHARS)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)
