"""Token sampling for the embedded engine: processed distributions and per-sequence randomness.

No megatron import: unit-testable on its own.

Conventions (SGLang's): temperature 0 is greedy; otherwise logits are divided by the
temperature, top-k keeps the k largest, and top-p keeps the smallest prefix of the
descending-sorted softmax(logits / temperature) whose mass reaches top_p (computed on the full
distribution, then intersected with top-k). The token is drawn from the renormalised kept
distribution by inverse-CDF sampling with one uniform per row, and the reported log-prob is
the token's log-prob under that renormalised distribution; for greedy it is the log-prob under
the unprocessed model distribution (a point mass would report 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gspo_megatron.rollout.base import SamplingParams

_MASK64 = (1 << 64) - 1


def sequence_seed(seed: int, key: int) -> int:
    """A 63-bit generator seed for sequence `key` of a call seeded with `seed` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + key + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sequence_uniforms(seed: int, keys: Sequence[int], count: int) -> torch.Tensor:
    """float64 [len(keys), count]: uniforms in [0, 1), row i from its own seeded generator."""
    out = torch.empty(len(keys), count, dtype=torch.float64)
    gen = torch.Generator()
    for row, key in zip(out.unbind(0), keys, strict=True):
        gen.manual_seed(sequence_seed(seed, key))
        torch.rand(count, generator=gen, dtype=torch.float64, out=row)
    return out


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens int64 [B], their log-probs float32 [B]).

    logits: float32 [B, V] over the real vocabulary. uniforms: float64 [B] in [0, 1). The
    log-probs are those of the distribution sampled from (see the module docstring).
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
    x = logits / params.temperature if params.temperature != 1 else logits
    vocab = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k or params.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_x, dtype=torch.bool)
        if top_k:
            keep[:, top_k:] = False
        if params.top_p < 1:
            probs = torch.softmax(sorted_x, dim=-1)
            keep &= (probs.cumsum(dim=-1) - probs) < params.top_p
        x = x.masked_fill(~torch.zeros_like(keep).scatter(1, order, keep), -math.inf)
    logp = torch.log_softmax(x, dim=-1)
    cdf = logp.double().exp().cumsum(dim=-1)
    # [B, 1] columns throughout: no reshaping between the steps
    target = uniforms[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # u * total rounding up to total could land on a trailing masked token: take the mode
    # (unconditionally, so that no host sync decides it).
    modes = logp.argmax(dim=-1, keepdim=True)
    tokens = torch.where(torch.isinf(logp.gather(1, tokens)), modes, tokens)
    return tokens.squeeze(1), logp.gather(1, tokens).squeeze(1)
