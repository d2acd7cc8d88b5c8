"""Benchmark metrics over n sampled responses per problem (pure Python, float64).

`correct` is a [problems, n] table of 0/1 (a response solves the problem when its reward is
>= 1, the same rule as the in-loop evaluation). For k <= n:

- avg@n: the mean of `correct` over every response of every problem (the GSPO paper's AIME
  "avg@32" with n = 32): the expected accuracy of one sample.
- pass@k: the probability that at least one of k responses drawn without replacement from the
  n solves the problem, with the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) /
  C(n, k) for c correct responses, computed as a product (no large binomials), averaged over
  problems. pass@1 = avg@n.
- maj@k: the first k responses vote with their answers (a response without one, None, does
  not vote); the problem counts as solved when the answer with the most votes (the earliest
  among equal counts) is a correct one, and as unsolved when no response has an answer.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence


def _count(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` as an int in [low, high]; a float, bool or other non-integer is refused (2.5
    samples is a caller's bug, not something to round)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # int and numpy integers; not float, not str
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if number < low or (high is not None and number > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bounds}, got {number}")
    return number


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples; n, c and k must be
    integers with 1 <= k <= n and 0 <= c <= n."""
    n = _count("pass@k's number of samples n", n, 1)
    k = _count(f"pass@k's k (n={n} samples)", k, 1, n)
    c = _count(f"pass@k's number correct c (n={n} samples)", c, 0, n)
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def _check_table(correct: Sequence[Sequence[float]]) -> int:
    if not correct:
        raise ValueError("no problems to score")
    n = len(correct[0])
    if n == 0 or any(len(row) != n for row in correct):
        raise ValueError("every problem needs the same number (>= 1) of samples")
    if any(x not in (0, 1) for row in correct for x in row):
        raise ValueError("correct must hold only 0 and 1")
    return n


def avg_at_n(correct: Sequence[Sequence[float]]) -> float:
    """Mean correctness over all samples of all problems."""
    n = _check_table(correct)
    return sum(sum(row) for row in correct) / (len(correct) * n)


def mean_pass_at_k(correct: Sequence[Sequence[float]], k: int) -> float:
    """pass@k averaged over problems."""
    n = _check_table(correct)
    return sum(pass_at_k(n, int(sum(row)), k) for row in correct) / len(correct)


def majority_solved(answers: Sequence[str | None], correct: Sequence[float], k: int) -> bool:
    """Whether the majority answer of the first k samples is a correct one."""
    if len(answers) != len(correct):
        raise ValueError(
            f"maj@k needs one answer per sample: {len(answers)} answers, {len(correct)} samples"
        )
    k = _count(f"maj@k's k ({len(answers)} samples)", k, 1, len(answers))
    votes: dict[str, int] = {}
    for answer in answers[:k]:
        if answer is not None:
            votes[answer] = votes.get(answer, 0) + 1
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == top)
    return any(a == winner and c for a, c in zip(answers[:k], correct[:k], strict=True))


def mean_maj_at_k(
    answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[float]], k: int
) -> float:
    """maj@k averaged over problems."""
    _check_table(correct)
    if len(answers) != len(correct):
        raise ValueError("answers and correct must cover the same problems")
    return sum(majority_solved(a, c, k) for a, c in zip(answers, correct, strict=True)) / len(
        correct
    )


def benchmark_metrics(
    correct: Sequence[Sequence[float]],
    ks: Sequence[int],
    answers: Sequence[Sequence[str | None]] | None = None,
) -> dict[str, float]:
    """{"avg@n", "pass@k" for each k, "maj@k" for each k > 1 when answers are given}."""
    n = _check_table(correct)
    ks = [_count("k", k, 1) for k in ks]
    too_large = [k for k in ks if k > n]
    if too_large:
        raise ValueError(f"k={too_large[0]} is larger than the {n} samples per problem")
    out = {f"avg@{n}": avg_at_n(correct)}
    for k in ks:
        out[f"pass@{k}"] = mean_pass_at_k(correct, k)
        if answers is not None and k > 1:
            out[f"maj@{k}"] = mean_maj_at_k(answers, correct, k)
    return out
