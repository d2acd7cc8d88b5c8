"""Synthetic verifiable tasks a tiny, randomly initialised model can learn on CPU with RL.

Each task makes (prompt, target) pairs of digit strings with short prompts for the character
tokenizer (`gspo_megatron.data.tokenizer`):

    copy     "copy:4071="  -> "4071"
    reverse  "rev:4071="   -> "1704"
    sort     "sort:4071="  -> "0147"
    add      "35+807="     -> "842"     ("248" with reverse_answer=True: least significant first)
    lookup   "code:kqz="   -> "4096"    (the code of a key, found with the retrieval environment's
                                         search tool: gspo_megatron/envs/retrieval.py)
    expr     "842="        -> a Python expression whose value prints as 842 ("842", "800+42",
                                         ...), run in the sandbox by the code reward (reward=code;
                                         "35+807=" with terms=2; tokenizer char_expr)

`min_digits` / `max_digits` set the difficulty (digits of the string; of each operand for add).
The reward gives partial credit per position:

    partial_credit(r, t) = #{i : r[i] == t[i]} / max(len(r), len(t))

over the response as generated: every token before the end token, whitespace included (a space
is a token the policy chose). It lies in [0, 1] and equals 1 only for an exact solve, so accuracy
(reward >= 1) counts exact solves. A response that is too long or too short loses credit for
every missing or extra position. A response that never stops runs to `rollout.max_new_tokens`
tokens, which the configuration keeps longer than any target (`room_for_the_end_token`): full
credit therefore needs the answer followed by the end token, and the policy learns to stop.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass
from typing import Any, ClassVar

DIGITS = "0123456789"


def partial_credit(response: str, target: str) -> float:
    """Fraction of positions where response and target agree, over the longer length."""
    longest = max(len(response), len(target))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, target, strict=False)) / longest


def exact_solve(response: str, target: str) -> bool:
    return response == target


def _digit_string(rng: random.Random, min_digits: int, max_digits: int) -> str:
    n = rng.randint(min_digits, max_digits)
    return "".join(rng.choice(DIGITS) for _ in range(n))


def _check_range(name: str, min_digits: int, max_digits: int) -> None:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"synthetic task {name}: need 1 <= min_digits <= max_digits, got "
            f"min_digits={min_digits}, max_digits={max_digits}"
        )


@dataclass(frozen=True)
class SyntheticTask:
    """Base: a digit-string transformation with a length knob."""

    name: ClassVar[str] = ""
    min_digits: int = 2
    max_digits: int = 6
    prefix: str = ""

    def __post_init__(self) -> None:
        _check_range(self.name, self.min_digits, self.max_digits)

    def transform(self, digits: str) -> str:
        raise NotImplementedError

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One (prompt, target) pair drawn from `rng`."""
        digits = _digit_string(rng, self.min_digits, self.max_digits)
        return f"{self.prefix}{digits}=", self.transform(digits)

    def max_prompt_chars(self) -> int:
        return len(self.prefix) + self.max_digits + 1

    def max_target_chars(self) -> int:
        return self.max_digits


@dataclass(frozen=True)
class CopyTask(SyntheticTask):
    name: ClassVar[str] = "copy"
    prefix: str = "copy:"

    def transform(self, digits: str) -> str:
        return digits


@dataclass(frozen=True)
class ReverseTask(SyntheticTask):
    name: ClassVar[str] = "reverse"
    prefix: str = "rev:"

    def transform(self, digits: str) -> str:
        return digits[::-1]


@dataclass(frozen=True)
class SortTask(SyntheticTask):
    name: ClassVar[str] = "sort"
    prefix: str = "sort:"

    def transform(self, digits: str) -> str:
        return "".join(sorted(digits))


@dataclass(frozen=True)
class AddTask(SyntheticTask):
    """a + b with each operand of min_digits..max_digits digits (no leading zeros)."""

    name: ClassVar[str] = "add"
    min_digits: int = 1
    max_digits: int = 2
    reverse_answer: bool = False

    def _operand(self, rng: random.Random) -> int:
        n = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = self._operand(rng), self._operand(rng)
        answer = str(a + b)
        return f"{self.prefix}{a}+{b}=", answer[::-1] if self.reverse_answer else answer

    def max_prompt_chars(self) -> int:
        return len(self.prefix) + 2 * self.max_digits + 2

    def max_target_chars(self) -> int:
        return self.max_digits + 1


def lookup_code(key: str) -> str:
    """The 4-digit code of a key: a pure function of the key, so the data set and the retrieval
    environment's corpus agree without sharing state."""
    digest = hashlib.blake2b(f"lookup|{key}".encode(), digest_size=8).digest()
    return f"{int.from_bytes(digest, 'big') % 10_000:04d}"


@dataclass(frozen=True)
class LookupTask(SyntheticTask):
    """The code of a key of min_digits..max_digits lowercase letters (not computable from the
    prompt: the policy has to look it up)."""

    name: ClassVar[str] = "lookup"
    min_digits: int = 3
    max_digits: int = 3
    prefix: str = "code:"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        n = rng.randint(self.min_digits, self.max_digits)
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
        return f"{self.prefix}{key}=", lookup_code(key)

    def max_target_chars(self) -> int:
        return 4


@dataclass(frozen=True)
class ExprTask(SyntheticTask):
    """Write a Python expression whose printed value is the target: the prompt shows `terms`
    numbers of min_digits..max_digits digits joined by "+" (no leading zeros: Python refuses
    them in integer literals), and the output must be their sum. Copying the prompt's
    expression solves it, whatever the sum: the interpreter does the arithmetic.

    The label is a code problem for the code reward (reward=code, scoring=partial: per-position
    credit of the printed output): one test with no input, the answer an expression, and no
    program longer than the prompt's longest expression. A response that never stops is
    `rollout.max_new_tokens` long, which the configuration keeps longer than that, so full
    credit needs the expression followed by the end token, as in the other tasks.
    """

    name: ClassVar[str] = "expr"
    min_digits: int = 2
    max_digits: int = 3
    prefix: str = ""
    terms: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.terms <= 4:
            raise ValueError(f"synthetic task expr: terms must be 1..4, got {self.terms}")

    def _number(self, rng: random.Random) -> int:
        n = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)

    def sample(self, rng: random.Random) -> tuple[str, dict[str, Any]]:  # type: ignore[override]
        numbers = [self._number(rng) for _ in range(self.terms)]
        expression = "+".join(map(str, numbers))
        label = {
            "tests": [{"input": "", "output": f"{sum(numbers)}\n"}],
            "mode": "expression",
            "max_program_chars": self.max_target_chars(),
        }
        return f"{self.prefix}{expression}=", label

    def max_prompt_chars(self) -> int:
        return len(self.prefix) + self.max_target_chars() + 1

    def max_target_chars(self) -> int:
        """The longest answer: the longest expression a prompt shows."""
        return self.terms * (self.max_digits + 1) - 1


SYNTHETIC_TASKS: dict[str, type[SyntheticTask]] = {
    t.name: t for t in (CopyTask, ReverseTask, SortTask, AddTask, LookupTask, ExprTask)
}
# Tasks whose labels are code problems, scored by reward=code (or a reward of the user's).
CODE_TASKS = frozenset({"expr"})


def make_task(name: str, **kwargs: Any) -> SyntheticTask:
    """A task by name: copy, reverse, sort, add, lookup, expr (kwargs: min_digits, max_digits,
    ...)."""
    if name not in SYNTHETIC_TASKS:
        raise ValueError(
            f"unknown synthetic task {name!r}; choose one of {sorted(SYNTHETIC_TASKS)}"
        )
    return SYNTHETIC_TASKS[name](**kwargs)


class SyntheticReward:
    """Per-position partial credit against the label (the target string); 1.0 = exact solve.

    With `partial=False` the reward is 1 for an exact solve and 0 otherwise.
    """

    inline_safe = True

    def __init__(self, partial: bool = True) -> None:
        self.partial = partial

    def answer(self, response: str) -> str:
        """The response itself: it is the answer (maj@k's vote)."""
        return response

    def __call__(self, prompt: str, response: str, label: Any) -> float:
        target = str(label)
        if self.partial:
            return partial_credit(response, target)
        return float(exact_solve(response, target))
