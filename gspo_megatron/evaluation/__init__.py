"""Evaluation on benchmarks: metrics over n sampled responses per problem (docs/EVALUATION.md)."""

from .metrics import (
    avg_at_n,
    benchmark_metrics,
    majority_solved,
    mean_maj_at_k,
    mean_pass_at_k,
    pass_at_k,
)

__all__ = [
    "avg_at_n",
    "benchmark_metrics",
    "majority_solved",
    "mean_maj_at_k",
    "mean_pass_at_k",
    "pass_at_k",
]
