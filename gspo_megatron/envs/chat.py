"""Observation tokens as the tokenizer's chat template renders them, appended after a model turn.

Token-in / token-out: a trajectory's earlier tokens (the model's sampled ids) are never decoded
and tokenised again, since re-tokenised text can split differently from what the policy sampled
and then the importance ratio compares different sequences. Only the new messages are rendered:
the template renders a fixed conversation followed by them (and the next turn's generation
prompt) twice, with two assistant turns that differ only in their last character; the text the
two renderings end with in common, after the assistant turn's end token, is the observation.
What the template puts after that end token (Qwen3: "\n" after <|im_end|>) belongs to the
observation, since the model's turn ends with that token when it stops.

How the template renders the earlier messages does not matter: Qwen3's renders an assistant
turn with an empty think block as the last message but without it once a message follows (its
template is not prefix-preserving); the trajectory keeps what the model sampled either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Two assistant turns that differ only in their last character: the renderings of the same
# messages after them share everything from the end of that turn on.
_TURNS = (".", ",")


class ChatFormat:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "multi-turn rollouts (env.name) need a tokenizer with a chat template "
                "(model.tokenizer); the character tokenizer with tool tokens is 'char_tools'"
            )
        if not tokenizer.eos_token:
            raise ValueError(
                "multi-turn rollouts (env.name) need a tokenizer with an end token (eos_token): "
                "a model turn ends with it and the observation starts after it"
            )
        self.tokenizer = tokenizer
        self.end = tokenizer.eos_token

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def observation_text(self, contents: Sequence[str], role: str) -> str:
        """What the template renders after a model turn's end token for messages of `role`,
        through the next turn's generation prompt."""
        new = [{"role": role, "content": c} for c in contents]
        a, b = (
            self._render(
                [{"role": "user", "content": "?"}, {"role": "assistant", "content": turn}, *new],
                generation_prompt=True,
            )
            for turn in _TURNS
        )
        common = _common_suffix(a, b)
        cut = common.find(self.end)
        if cut < 0:
            raise ValueError(
                f"the tokenizer's chat template does not end an assistant turn with the end "
                f"token {self.end!r} before a {role!r} message, so where an observation starts "
                "is not defined; use a template that closes each turn with eos_token"
            )
        return common[cut + len(self.end) :]

    def message_ids(self, contents: Sequence[str], role: str) -> list[int]:
        """Messages of `role` after a model turn, through the next turn's generation prompt."""
        return self._encode(self.observation_text(contents, role))

    def user_ids(self, text: str) -> list[int]:
        """An episode's initial context from a user message, through the generation prompt."""
        return self._encode(self._render([{"role": "user", "content": text}], True))


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]
