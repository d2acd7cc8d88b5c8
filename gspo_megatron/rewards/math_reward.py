"""Math answer verification with Hugging Face's `math-verify`.

`MathVerifyReward()(prompt, response, label)` is 1.0 when the response's final answer equals the
gold answer `label` mathematically (1/2 = 0.5 = \\frac{1}{2}, (x+1)^2 = x^2+2x+1, ...), else 0.0.

Where the answer is read from the response (`answer_format`):
- "auto" (default): math-verify's own extraction: \\boxed{...} first, then "final answer is",
  "Answer:", and the last expression.
- "boxed": only \\boxed{...} / \\fbox{...} (MATH and DeepSeek-R1 style prompts).
- "gsm8k": only the text after the last "####".
- "dapo": only the text after the last "Answer:" (DAPO-Math-17k's prompt asks for
  "Answer: $Answer" on the last line).
With a strict format, a response without the marker scores 0.

The gold label may be a bare answer ("72", "\\frac{1}{2}", "$\\frac{1}{2}$", "\\boxed{3}") or a
GSM8K solution ending in "#### 72" (the text after the last "####" is used); "1,000" style
thousands separators are accepted.

math-verify times itself out with SIGALRM, which only works in a main thread; in any other
thread the library's timeouts are switched off (the scorer's timeout still applies). The scorer
runs this reward in worker processes, where each call is on the main thread.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Literal

AnswerFormat = Literal["auto", "boxed", "gsm8k", "dapo"]
ANSWER_FORMATS = ("auto", "boxed", "gsm8k", "dapo")

_DAPO_ANSWER = re.compile(r"Answer\s*:", re.IGNORECASE)
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


def _after_last(text: str, marker: str | re.Pattern) -> str | None:
    if isinstance(marker, str):
        pos = text.rfind(marker)
        return None if pos < 0 else text[pos + len(marker) :]
    matches = list(marker.finditer(text))
    return None if not matches else text[matches[-1].end() :]


def _first_line_after(text: str, marker: str | re.Pattern) -> str | None:
    part = _after_last(text, marker)
    if part is None:
        return None
    lines = part.strip().splitlines()
    return lines[0].strip() if lines else ""


def _normalize_gold(label: Any) -> str:
    gold = str(label).strip()
    after = _after_last(gold, "####")
    if after is not None:
        gold = after.strip()
    if _THOUSANDS.match(gold):
        gold = gold.replace(",", "")
    if "$" not in gold and "\\boxed" not in gold and "\\(" not in gold:
        gold = f"${gold}$"
    return gold


class MathVerifyReward:
    """1.0 if the response's final answer verifies against the gold label, else 0.0."""

    def __init__(
        self,
        answer_format: AnswerFormat = "auto",
        float_rounding: int = 6,
        parsing_timeout_s: int = 5,
    ) -> None:
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"math reward answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}"
            )
        self.answer_format = answer_format
        self.float_rounding = float_rounding
        self.parsing_timeout_s = parsing_timeout_s

    def extract(self, response: str) -> str | None:
        """The part of the response that holds the answer (None: no answer marker)."""
        if self.answer_format == "gsm8k":
            return _first_line_after(response, "####")
        if self.answer_format == "dapo":
            return _first_line_after(response, _DAPO_ANSWER)
        return response

    def _prediction(self, response: str, timeout: int | None) -> list | None:
        """math-verify's parse of the response's answer, or None when it has none."""
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

        text = self.extract(response)
        if not text:
            return None
        if self.answer_format == "boxed":
            configs = [LatexExtractionConfig(try_extract_without_anchor=False)]
            if "\\boxed" not in text and "\\fbox" not in text:
                return None
        else:
            configs = [LatexExtractionConfig(), ExprExtractionConfig()]
        if self.answer_format in ("gsm8k", "dapo") and _THOUSANDS.match(text):
            text = text.replace(",", "")
        return parse(text, extraction_config=configs, parsing_timeout=timeout) or None

    def _timeout(self) -> int | None:
        if threading.current_thread() is not threading.main_thread():
            return None  # SIGALRM cannot be used off the main thread
        return self.parsing_timeout_s

    def answer(self, response: str) -> str | None:
        """The response's answer as math-verify reads it (maj@k's vote), None when it has none."""
        pred = self._prediction(response, self._timeout())
        return None if pred is None else str(pred[0])

    def __call__(self, prompt: str, response: str, label: Any) -> float:
        from math_verify import parse, verify

        timeout = self._timeout()
        gold = parse(_normalize_gold(label), parsing_timeout=timeout)
        if not gold:
            raise ValueError(f"math-verify could not parse the gold answer {label!r:.80}")
        pred = self._prediction(response, timeout)
        if pred is None:
            return 0.0
        ok = verify(gold, pred, float_rounding=self.float_rounding, timeout_seconds=timeout)
        return 1.0 if ok else 0.0
