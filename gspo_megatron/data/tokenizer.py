"""A character-level tokenizer built locally (no download) for the synthetic tasks and CPU demos.

    tok = load_tokenizer("char")          # CharTokenizer: plain Python, 48 tokens
    tok("rev:1234=").input_ids            # [1, 31, 18, 35, 44, 5, 6, 7, 8, 43]  (<bos> first)
    tok.eos_token_id                      # 2: the stop token for generation
    tok.save_pretrained(path)             # as transformers' tokenizer files (tok.to_hf())
    load_tokenizer(path)                  # AutoTokenizer.from_pretrained(path) gives it back
    build_char_tokenizer()                # the same tokenizer as a PreTrainedTokenizerFast

`CharTokenizer` does what the trainer asks of a tokenizer (encode one text or a batch, with
or without <bos>; decode; the chat template; the vocabulary) without importing transformers,
whose import costs more than a second of every run's start; `to_hf()` builds the equivalent
transformers tokenizer (a test compares the two on random texts, ids and conversations).

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

import json
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True)
class CharVocabulary:
    """What defines a character tokenizer: its characters, extra tokens (each one token, after
    the characters; special, like <pad> <bos> <eos> <unk>), chat template and length limit."""

    chars: str = DEFAULT_CHARS
    chat_template: str | None = CHAT_TEMPLATE
    model_max_length: int = 128
    extra_tokens: tuple[str, ...] = ()


CHAR_VOCABULARIES = {
    CHAR_TOKENIZER_NAME: CharVocabulary(),
    TOOL_CHAR_TOKENIZER_NAME: CharVocabulary(
        TOOL_CHARS, TOOL_CHAT_TEMPLATE, extra_tokens=TOOL_TOKENS + TOOL_WORDS
    ),
    EXPR_CHAR_TOKENIZER_NAME: CharVocabulary(EXPR_CHARS),
}


class Encoding(dict):
    """`{"input_ids": ...}` that also reads as `.input_ids`, as transformers' BatchEncoding."""

    @property
    def input_ids(self):
        return self["input_ids"]


class CharTokenizer:
    """The character tokenizer in plain Python (see the module docstring): the part of
    transformers' tokenizer API the trainer, the data sets and the environments call."""

    def __init__(self, vocabulary: CharVocabulary = CharVocabulary()) -> None:
        _check_chars(vocabulary.chars)
        self.vocabulary = vocabulary
        tokens = (*SPECIAL_TOKENS, *vocabulary.chars, *vocabulary.extra_tokens)
        self._ids = {tok: i for i, tok in enumerate(tokens)}
        self._tokens = list(tokens)
        self._special = {self._ids[t] for t in (*SPECIAL_TOKENS, *vocabulary.extra_tokens)}
        # Added tokens are found in the text first, leftmost and then longest (as the
        # tokenizers library does); the rest is one token per character.
        added = sorted((*SPECIAL_TOKENS, *vocabulary.extra_tokens), key=len, reverse=True)
        self._added = re.compile("|".join(re.escape(t) for t in added))
        self.chat_template = vocabulary.chat_template
        self._compiled: tuple[str, Any] | None = None  # (template, its compiled form)
        self.model_max_length = vocabulary.model_max_length
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = SPECIAL_TOKENS
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = range(4)

    def __len__(self) -> int:
        return len(self._tokens)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        unk, start = self.unk_token_id, 0
        for match in self._added.finditer(text):
            ids.extend(self._ids.get(c, unk) for c in text[start : match.start()])
            ids.append(self._ids[match.group()])
            start = match.end()
        ids.extend(self._ids.get(c, unk) for c in text[start:])
        return ids

    def __call__(
        self,
        text: str | Sequence[str],
        add_special_tokens: bool = True,
        return_attention_mask: bool = False,
    ) -> Encoding:
        if return_attention_mask:
            raise ValueError("CharTokenizer returns input_ids only (return_attention_mask=False)")
        if isinstance(text, str):
            return Encoding(input_ids=self.encode(text, add_special_tokens))
        return Encoding(input_ids=[self.encode(t, add_special_tokens) for t in text])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Ids outside the vocabulary are left out, as transformers does."""
        n = len(self._tokens)
        return "".join(
            self._tokens[i]
            for i in ids
            if 0 <= i < n and not (skip_special_tokens and i in self._special)
        )

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self._ids.get(tokens, self.unk_token_id)
        return [self._ids.get(t, self.unk_token_id) for t in tokens]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tokens[i] if 0 <= i < len(self._tokens) else None for i in ids]

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered by the chat template, as transformers renders it (Jinja
        with trim_blocks and lstrip_blocks); text only."""
        if tokenize:
            raise ValueError(
                "CharTokenizer.apply_chat_template renders text (tokenize=False); encode it "
                "with encode(text, add_special_tokens=False)"
            )
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _jinja_template(self.chat_template))
        return self._compiled[1].render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            unk_token=self.unk_token,
            **kwargs,
        )

    def to_hf(self) -> PreTrainedTokenizerFast:
        """The same tokenizer as transformers' PreTrainedTokenizerFast."""
        v = self.vocabulary
        return build_char_tokenizer(v.chars, v.chat_template, v.model_max_length, v.extra_tokens)

    def save_pretrained(self, path) -> tuple[str, ...]:
        """transformers' tokenizer files, which AutoTokenizer (and load_tokenizer) reads."""
        return self.to_hf().save_pretrained(path)


def _jinja_template(source: str):
    """A chat template compiled as transformers compiles it (the parts a template uses)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _check_chars(chars: str) -> None:
    if len(set(chars)) != len(chars):
        dupes = sorted({c for c in chars if chars.count(c) > 1})
        raise ValueError(f"char tokenizer: duplicate characters {dupes!r}")
    if not chars:
        raise ValueError("char tokenizer: `chars` is empty")


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

    _check_chars(chars)
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
    return CharTokenizer(CHAR_VOCABULARIES[TOOL_CHAR_TOKENIZER_NAME]).to_hf()


def load_tokenizer(name_or_path: str) -> CharTokenizer | PreTrainedTokenizerBase:
    """ "char" / "char_tools" / "char_expr" are the character tokenizers (CharTokenizer);
    anything else goes to AutoTokenizer."""
    if name_or_path in CHAR_VOCABULARIES:
        return CharTokenizer(CHAR_VOCABULARIES[name_or_path])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)
