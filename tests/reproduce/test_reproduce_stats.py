"""benchmarks/reproduce/stats.py against exact counts and closed forms."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
from reproduce.test_reproduce_smoke import _module

stats = _module("stats")


def _exact_p(a, b):
    """Share of all splits of the pooled values whose |mean difference| reaches the observed."""
    pooled, n = [*a, *b], len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), n):
        left = [pooled[i] for i in idx]
        right = [pooled[i] for i in range(len(pooled)) if i not in idx]
        total += 1
        hits += abs(statistics.fmean(left) - statistics.fmean(right)) >= observed - 1e-12
    return hits / total


def test_permutation_p_is_exact_on_small_samples():
    assert stats.permutation_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert stats.permutation_p([0.3] * 4, [0.3] * 3) == 1.0
    a, b = [0.61, 0.72, 0.55, 0.80, 0.66], [0.58, 0.49, 0.70, 0.52]
    assert stats.permutation_p(a, b) == pytest.approx(_exact_p(a, b))


def test_sampled_permutations_approach_the_exact_p():
    a = [0.61, 0.72, 0.55, 0.80, 0.66, 0.71, 0.59, 0.64]
    b = [0.58, 0.49, 0.70, 0.52, 0.60, 0.57, 0.63, 0.50]
    exact = stats.permutation_p(a, b)  # C(16, 8) = 12870 splits: enumerated
    sampled = stats.permutation_p(a, b, rounds=5000, seed=1)
    assert math.comb(16, 8) <= 20_000 and abs(sampled - exact) < 0.015, (sampled, exact)


def test_bootstrap_interval_and_seed_count():
    low, high = stats.bootstrap_ci([1.0, 1.0, 1.0], [0.25, 0.25])
    assert low == high == 0.75
    a, b = [0.61, 0.72, 0.55, 0.80, 0.66], [0.58, 0.49, 0.70, 0.52]
    low, high = stats.bootstrap_ci(a, b)
    assert low < stats.mean_difference(a, b) < high and low > -0.2 and high < 0.35
    # (1.959964 + 0.841621)^2 * (1 + 1) / 1 = 15.7
    assert stats.seeds_needed(1.0, 1.0, 1.0) == 16
    assert stats.seeds_needed(0.1, 0.1, 0.05) == 63
    # what 16 seeds each detect is the difference 16 seeds were sized for
    assert stats.detectable_difference(1.0, 16, 1.0, 16) == pytest.approx(0.99, abs=0.01)
    with pytest.raises(ValueError, match="delta"):
        stats.seeds_needed(1.0, 1.0, 0.0)


def test_compare_says_which_is_larger_only_when_significant():
    higher = stats.compare([0.9, 0.95, 0.92, 0.91, 0.93], [0.5, 0.55, 0.52, 0.51, 0.53])
    assert higher["verdict"] == "A > B" and higher["p"] == pytest.approx(2 / 252)
    same = stats.compare([0.5, 0.7, 0.6], [0.6, 0.5, 0.7])
    assert same["verdict"] == "undecided" and same["p"] == 1.0
    # equal within a margin: the 90% interval of the difference inside (-margin, +margin)
    close = [0.50, 0.51, 0.52, 0.50, 0.51], [0.51, 0.50, 0.52, 0.51, 0.50]
    assert stats.compare(*close, margin=0.05)["verdict"] == "equivalent"
    assert stats.compare(*close, margin=0.001)["verdict"] == "undecided"
    assert stats.compare(*close)["verdict"] == "undecided"  # no margin, no equivalence
    assert same["seeds_for_power_0.8"] == -1  # no observed difference to size a sweep for
