"""Observation tokens as the tokenizer's chat template renders them, appended after a model turn.

Token-in / token-out: a trajectory's earlier tokens (the model's sampled ids) are never decoded
and tokenised again, since re-tokenised text can split differently from what the policy sampled
and then the importance ratio compares different sequences. Only the new messages are rendered:
the template renders a fixed conversation with and without them (and the next turn's generation
prompt) and the difference is tokenised. What the template puts after an assistant turn's end
token (Qwen3: "\n" after <|im_end|>) belongs to the observation, since the model's turn ends
with that token when it stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BASE = ({"role": "user", "content": "?"}, {"role": "assistant", "content": "."})


class ChatFormat:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "multi-turn rollouts (env.name) need a tokenizer with a chat template "
                "(model.tokenizer); the character tokenizer with tool tokens is 'char_tools'"
            )
        self.tokenizer = tokenizer
        self._base_text = self._render(list(_BASE), generation_prompt=False)
        end = tokenizer.eos_token or ""
        cut = self._base_text.rfind(end) if end else -1
        self._after_turn = self._base_text[cut + len(end) :] if cut >= 0 else ""

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def message_ids(self, contents: Sequence[str], role: str) -> list[int]:
        """Messages of `role` after a model turn, through the next turn's generation prompt."""
        messages = [*_BASE, *({"role": role, "content": c} for c in contents)]
        full = self._render(messages, generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ValueError(
                f"the tokenizer's chat template renders earlier messages differently once a "
                f"{role!r} message follows them, so observations cannot be appended token by "
                "token; use a template that renders each message on its own"
            )
        return self._encode(self._after_turn + full[len(self._base_text) :])

    def user_ids(self, text: str) -> list[int]:
        """An episode's initial context from a user message, through the generation prompt."""
        return self._encode(self._render([{"role": "user", "content": text}], True))
