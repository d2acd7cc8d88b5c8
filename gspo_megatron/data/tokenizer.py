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
CHAR_TOKENIZER_NAME = "char"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_char_tokenizer(
    chars: str = DEFAULT_CHARS,
    chat_template: str | None = CHAT_TEMPLATE,
    model_max_length: int = 128,
) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `chars` plus <pad>, <bos>, <eos>, <unk>."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(chars)) != len(chars):
        dupes = sorted({c for c in chars if chars.count(c) > 1})
        raise ValueError(f"char tokenizer: duplicate characters {dupes!r}")
    if not chars:
        raise ValueError("char tokenizer: `chars` is empty")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    # BPE without merges = one token per character; unknown characters -> <unk>.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens(list(SPECIAL_TOKENS))
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


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """ "char" builds the character tokenizer; anything else goes to AutoTokenizer."""
    if name_or_path == CHAR_TOKENIZER_NAME:
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)
