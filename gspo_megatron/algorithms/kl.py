"""Per-token estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

With log r = ref_logprobs - logprobs (r = pi_ref / pi, evaluated on samples of pi), following
Schulman's note "Approximating KL divergence" (2020):

- ``k1``: -log r. Unbiased, high variance, can be negative.
- ``k2``: (log r)^2 / 2. Biased (low bias when pi ~ pi_ref), non-negative, low variance.
- ``k3``: r - 1 - log r. Unbiased and non-negative; lower variance than k1.
- ``low_var_kl``: k3 with log r clamped to [-20, 20] and the result clamped to [-10, 10]
  (the form verl calls ``low_var_kl``): bounded, hence biased for distant policies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

from ._checks import require_tensor

LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0


def _k1(log_r: Tensor) -> Tensor:
    return -log_r


def _k2(log_r: Tensor) -> Tensor:
    return 0.5 * log_r.square()


def _k3(log_r: Tensor) -> Tensor:
    return torch.expm1(log_r) - log_r


def _low_var_kl(log_r: Tensor) -> Tensor:
    log_r = log_r.clamp(-LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
    return _k3(log_r).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


KL_ESTIMATORS: Mapping[str, Callable[[Tensor], Tensor]] = MappingProxyType(
    {"k1": _k1, "k2": _k2, "k3": _k3, "low_var_kl": _low_var_kl}
)
"""Estimator name -> function of the per-token log r = log pi_ref - log pi."""


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(pi || pi_ref) estimate, same shape as ``logprobs``; differentiable in both.

    Args:
        logprobs: log pi of the sampled tokens, any shape.
        ref_logprobs: log pi_ref of the same tokens, same shape.
        estimator: one of :data:`KL_ESTIMATORS`.
    """
    fn = KL_ESTIMATORS.get(estimator)
    if fn is None:
        raise ValueError(f"kl_estimator must be one of {sorted(KL_ESTIMATORS)}, got {estimator!r}")
    logprobs = require_tensor("logprobs", logprobs, floating=True)
    ref_logprobs = require_tensor("ref_logprobs", ref_logprobs, floating=True)
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs must have the shape of logprobs {list(logprobs.shape)}, "
            f"got {list(ref_logprobs.shape)}"
        )
    return fn(ref_logprobs - logprobs)
