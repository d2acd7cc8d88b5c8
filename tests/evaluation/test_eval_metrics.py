"""Benchmark metrics against references of their own: pass@k by enumerating every k-subset of
the samples in exact fractions, avg@n and maj@k by loops over small tables."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from gspo_megatron.evaluation import (
    avg_at_n,
    benchmark_metrics,
    majority_solved,
    mean_maj_at_k,
    mean_pass_at_k,
    pass_at_k,
)


def enumerated_pass_at_k(row: list[int], k: int) -> Fraction:
    """The share of the k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(range(len(row)), k))
    return Fraction(sum(any(row[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_the_share_of_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        row = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            expected = enumerated_pass_at_k(row, k)
            assert pass_at_k(n, c, k) == pytest.approx(float(expected), rel=1e-12, abs=1e-15)


def test_pass_at_k_edges():
    assert pass_at_k(16, 0, 1) == 0.0 and pass_at_k(16, 0, 16) == 0.0  # c = 0
    assert pass_at_k(16, 16, 1) == 1.0 and pass_at_k(16, 16, 16) == 1.0  # c = n
    assert pass_at_k(16, 1, 16) == 1.0  # n - c < k: every k-subset holds the correct one
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16, rel=1e-15)
    # large n: the product form stays finite where binomials would not fit a float
    assert 0.0 < pass_at_k(5000, 1, 10) == pytest.approx(10 / 5000, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


@pytest.mark.parametrize(
    ("n", "c", "k", "match"),
    [
        (8, 3, 2.5, r"pass@k's k \(n=8 samples\) must be an integer, got float 2.5"),
        (8, 3, 2.0, "k .* must be an integer, got float 2.0"),
        (8, 3.0, 2, "number correct c .* must be an integer, got float 3.0"),
        (8.5, 3, 2, "number of samples n must be an integer, got float 8.5"),
        (8, True, 2, "must be an integer, got True"),
        (8, 3, "2", "must be an integer, got str '2'"),
        (0, 0, 1, r"number of samples n must be in >= 1, got 0"),
        (8, 9, 2, r"number correct c \(n=8 samples\) must be in \[0, 8\], got 9"),
        (8, 3, 9, r"k \(n=8 samples\) must be in \[1, 8\], got 9"),
    ],
)
def test_pass_at_k_refuses_non_integer_or_out_of_range_counts(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_pass_at_k_takes_numpy_integers():
    import numpy as np

    assert pass_at_k(np.int64(8), np.int32(3), np.int64(2)) == pass_at_k(8, 3, 2)


def test_table_metrics_refuse_a_non_integer_k():
    table = [[1, 0, 1, 0]]
    with pytest.raises(ValueError, match="k must be an integer, got float 1.5"):
        benchmark_metrics(table, [1.5])
    with pytest.raises(ValueError, match="maj@k's k .* must be an integer"):
        majority_solved(["a", "b"], [1, 0], 1.0)


def test_table_metrics_match_loops():
    rng = random.Random(3)
    table = [[int(rng.random() < p) for _ in range(8)] for p in (0.0, 0.1, 0.5, 0.9, 1.0, 0.3)]
    total = sum(sum(row) for row in table)
    assert avg_at_n(table) == pytest.approx(total / (6 * 8), rel=1e-15)
    assert mean_pass_at_k(table, 1) == pytest.approx(avg_at_n(table), rel=1e-12)
    for k in (1, 2, 4, 8):
        expected = sum(enumerated_pass_at_k(row, k) for row in table) / len(table)
        assert mean_pass_at_k(table, k) == pytest.approx(float(expected), rel=1e-12)


def test_majority_vote():
    # "7" has 2 votes of 3 and is correct
    assert majority_solved(["7", "3", "7"], [1, 0, 1], 3)
    # the majority answer is wrong though one sample is right
    assert not majority_solved(["3", "7", "3"], [0, 1, 0], 3)
    # a tie: the answer that came first wins
    assert majority_solved(["7", "3"], [1, 0], 2) and not majority_solved(["3", "7"], [0, 1], 2)
    # only the first k vote
    assert not majority_solved(["3", "7", "7"], [0, 1, 1], 1)
    # responses without an answer do not vote; with none at all the problem is unsolved
    assert majority_solved([None, None, "7"], [0, 0, 1], 3)
    assert not majority_solved([None, None], [0, 0], 2)
    answers = [["7", "3", "7"], ["3", "7", "3"], [None, "1", None]]
    correct = [[1, 0, 1], [0, 1, 0], [0, 1, 0]]
    assert mean_maj_at_k(answers, correct, 3) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="maj@k"):
        majority_solved(["7"], [1], 2)


def test_benchmark_metrics_keys_and_refusals():
    table = [[1, 0, 0, 1], [0, 0, 0, 0]]
    answers = [["a", "b", "c", "a"], ["x", "x", "y", "z"]]
    out = benchmark_metrics(table, [1, 2, 4], answers)
    assert set(out) == {"avg@4", "pass@1", "pass@2", "pass@4", "maj@2", "maj@4"}
    assert out["pass@4"] == 0.5 and out["avg@4"] == 0.25 and out["maj@4"] == 0.5
    assert "maj@2" not in benchmark_metrics(table, [2])
    with pytest.raises(ValueError, match="k=8 is larger than the 4 samples"):
        benchmark_metrics(table, [8])
    with pytest.raises(ValueError, match="same number"):
        benchmark_metrics([[1, 0], [1]], [1])
    with pytest.raises(ValueError, match="only 0 and 1"):
        benchmark_metrics([[0.5, 1]], [1])
    with pytest.raises(ValueError, match="no problems"):
        benchmark_metrics([], [1])
