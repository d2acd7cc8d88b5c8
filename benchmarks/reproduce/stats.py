"""Two-sample statistics for per-seed results (pure Python, no SciPy).

- `permutation_p`: the two-sided p-value of the difference of means under the null that the
  method does not matter (every split of the pooled values into groups of the same sizes is
  equally likely): exact when the number of splits is at most `rounds`, else estimated from
  `rounds` random splits (with the observed split counted, so p > 0).
- `bootstrap_ci`: a percentile confidence interval of the difference of means, resampling each
  group with replacement.
- `seeds_needed`: seeds per method for a two-sided test at level alpha to detect a difference
  `delta` with the given power, from the per-method standard deviations (normal approximation:
  n = (z_{1-alpha/2} + z_power)^2 (sd_a^2 + sd_b^2) / delta^2).
- `compare`: all of it for two methods, and a verdict; with a margin, equivalence too.
- `detectable_difference`: the difference that the seeds at hand detect with that power,
  (z_{1-alpha/2} + z_power) sqrt(sd_a^2 / n_a + sd_b^2 / n_b): an undecided comparison says
  the methods differ by less than about this much.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence


def mean_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.fmean(a) - statistics.fmean(b)


def permutation_p(
    a: Sequence[float], b: Sequence[float], *, rounds: int = 20_000, seed: int = 0
) -> float:
    if not a or not b:
        raise ValueError("both groups need at least one value")
    pooled = [*a, *b]
    observed = abs(mean_difference(a, b))
    total = math.fsum(pooled)
    n, m = len(a), len(b)
    # |mean(A) - mean(B)| of a split depends on sum(A) only: compare sums, with a tolerance
    # for float rounding so that splits as extreme as the observed one count.
    tolerance = 1e-12 * max(1.0, abs(total))

    def extreme(sum_a: float) -> bool:
        return abs(sum_a / n - (total - sum_a) / m) >= observed - tolerance

    if math.comb(n + m, n) <= rounds:
        splits = itertools.combinations(pooled, n)
        hits = count = 0
        for group in splits:
            count += 1
            hits += extreme(math.fsum(group))
        return hits / count
    rng = random.Random(seed)
    hits = 1  # the observed split
    for _ in range(rounds):
        hits += extreme(math.fsum(rng.sample(pooled, n)))
    return hits / (rounds + 1)


def bootstrap_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    level: float = 0.95,
    rounds: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    rng = random.Random(seed)
    differences = sorted(
        statistics.fmean(rng.choices(a, k=len(a))) - statistics.fmean(rng.choices(b, k=len(b)))
        for _ in range(rounds)
    )
    tail = (1 - level) / 2
    low = differences[int(math.floor(tail * (rounds - 1)))]
    high = differences[int(math.ceil((1 - tail) * (rounds - 1)))]
    return low, high


def _z(alpha: float, power: float) -> float:
    normal = statistics.NormalDist()
    return normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)


def detectable_difference(
    sd_a: float, n_a: int, sd_b: float, n_b: int, *, alpha: float = 0.05, power: float = 0.8
) -> float:
    return _z(alpha, power) * math.sqrt(sd_a**2 / n_a + sd_b**2 / n_b)


def seeds_needed(
    sd_a: float, sd_b: float, delta: float, *, alpha: float = 0.05, power: float = 0.8
) -> int:
    if delta <= 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    z = _z(alpha, power)
    return max(2, math.ceil(z * z * (sd_a**2 + sd_b**2) / delta**2))


def compare(
    a: Sequence[float],
    b: Sequence[float],
    *,
    alpha: float = 0.05,
    delta: float | None = None,
    margin: float | None = None,
) -> dict[str, float | int | str]:
    """Method A against method B: the difference of means, its 95% bootstrap interval, the
    permutation p-value, the difference these seeds detect with power 0.8, the seeds per method
    that would detect `delta` (default: the observed difference) with power 0.8, and a verdict
    at level alpha: "A > B" or "A < B" (the test rejects no difference), "equivalent" (with a
    `margin`: the 1 - 2 alpha bootstrap interval lies inside (-margin, +margin), the two
    one-sided tests' equivalence), else "undecided"."""
    difference = mean_difference(a, b)
    p = permutation_p(a, b)
    low, high = bootstrap_ci(a, b)
    sd_a = statistics.stdev(a) if len(a) > 1 else 0.0
    sd_b = statistics.stdev(b) if len(b) > 1 else 0.0
    effect = delta if delta is not None else abs(difference)
    verdict = "undecided"
    if p < alpha:
        verdict = "A > B" if difference > 0 else "A < B"
    out: dict[str, float | int | str] = {
        "difference": difference,
        "ci_low": low,
        "ci_high": high,
        "p": p,
        "n_a": len(a),
        "n_b": len(b),
        "detectable_at_power_0.8": detectable_difference(sd_a, len(a), sd_b, len(b), alpha=alpha),
        "seeds_for_power_0.8": seeds_needed(sd_a, sd_b, effect, alpha=alpha) if effect else -1,
    }
    if margin is not None:
        tost_low, tost_high = bootstrap_ci(a, b, level=1 - 2 * alpha)
        out |= {"margin": margin, "tost_ci_low": tost_low, "tost_ci_high": tost_high}
        if verdict == "undecided" and -margin < tost_low and tost_high < margin:
            verdict = "equivalent"
    return out | {"verdict": verdict}
