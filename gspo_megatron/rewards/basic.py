"""Exact-match and format rewards."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal


class ExactMatchReward:
    """1.0 when the response equals the label (or one of a list of labels), else 0.0.

    `strip` removes surrounding whitespace from both sides; `case_sensitive=False` compares
    casefolded strings.
    """

    inline_safe = True

    def __init__(self, strip: bool = True, case_sensitive: bool = True) -> None:
        self.strip = strip
        self.case_sensitive = case_sensitive

    def _norm(self, text: Any) -> str:
        text = str(text)
        if self.strip:
            text = text.strip()
        return text if self.case_sensitive else text.casefold()

    def answer(self, response: str) -> str:
        """The response as compared (maj@k's vote)."""
        return self._norm(response)

    def __call__(self, prompt: str, response: str, label: Any) -> float:
        accepted = label if isinstance(label, Sequence) and not isinstance(label, str) else [label]
        got = self._norm(response)
        return 1.0 if any(got == self._norm(a) for a in accepted) else 0.0


class FormatReward:
    """`reward` when the response matches a regular expression, else 0.0; the label is unused.

    The default asks for a \\boxed{...} answer. For R1-style output use
    `pattern=r"<think>.*?</think>\\s*<answer>.*?</answer>", mode="fullmatch"`.
    Not inline-safe: a user's pattern can backtrack for a long time on a long response, so the
    scorer runs it where its timeout applies.
    """

    def __init__(
        self,
        pattern: str = r"\\boxed\{.+?\}",
        mode: Literal["search", "fullmatch"] = "search",
        dotall: bool = True,
        reward: float = 1.0,
    ) -> None:
        if mode not in ("search", "fullmatch"):
            raise ValueError(f"format reward mode must be 'search' or 'fullmatch', got {mode!r}")
        try:
            self._regex = re.compile(pattern, re.DOTALL if dotall else 0)
        except re.error as exc:
            raise ValueError(
                f"format reward pattern {pattern!r} is not a valid regex: {exc}"
            ) from None
        self.mode = mode
        self.reward = float(reward)

    def __call__(self, prompt: str, response: str, label: Any) -> float:
        match = getattr(self._regex, self.mode)(response.strip())
        return self.reward if match else 0.0
