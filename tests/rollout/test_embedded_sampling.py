"""The embedded engine's token sampling: processed distributions, reported log-probs, seeding.

Pure torch (no megatron): `gspo_megatron.rollout.embedded.sampling`.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.embedded.sampling import sample_tokens, sequence_seed, sequence_uniforms


def logits_rows(rows: int = 4, vocab: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def kept_set(row: torch.Tensor, params: SamplingParams) -> set[int]:
    """SGLang's rule, written out: top-k, and the smallest top-p prefix of softmax(x / T)."""
    probs = torch.softmax(row / params.temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    kept, mass = set(), 0.0
    for rank, token in enumerate(order):
        if (params.top_k > 0 and rank >= params.top_k) or mass >= params.top_p:
            break
        kept.add(token)
        mass += float(probs[token])
    return kept


def test_greedy_takes_argmax_and_reports_model_logprob():
    logits = logits_rows()
    tokens, logp = sample_tokens(logits, SamplingParams(temperature=0), torch.rand(4).double())
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logp, expected, rtol=0, atol=0)


def test_temperature_one_logprob_is_log_softmax():
    logits = logits_rows()
    tokens, logp = sample_tokens(logits, SamplingParams(), torch.rand(4).double())
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logp, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.5),
    ],
)
def test_inverse_cdf_follows_processed_distribution(params):
    """A grid of uniforms hits every kept token in proportion to its renormalised probability."""
    row = logits_rows(1, vocab=9, seed=3)[0]
    grid = 20_000
    uniforms = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    tokens, logp = sample_tokens(row.expand(grid, -1), params, uniforms)
    kept = kept_set(row, params)
    assert set(tokens.tolist()) == kept
    x = (row / params.temperature).masked_fill(
        ~torch.isin(torch.arange(9), torch.tensor(sorted(kept))), -math.inf
    )
    expected = torch.log_softmax(x, -1)
    freq = torch.bincount(tokens, minlength=9).double() / grid
    torch.testing.assert_close(freq, expected.exp().double(), rtol=0, atol=2.0 / grid)
    torch.testing.assert_close(logp, expected[tokens], rtol=0, atol=1e-6)


def test_top_p_boundary_token_is_kept():
    # probabilities 0.5, 0.3, 0.2: top_p=0.5 keeps only the first, 0.51 keeps two
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    grid = (torch.arange(100, dtype=torch.float64) + 0.5) / 100
    tokens, _ = sample_tokens(logits.expand(100, -1), SamplingParams(top_p=0.5), grid)
    assert set(tokens.tolist()) == {0}
    tokens, logp = sample_tokens(logits.expand(100, -1), SamplingParams(top_p=0.51), grid)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logp[tokens == 1][0], torch.log(torch.tensor(0.3 / 0.8)))


def test_uniform_near_one_never_picks_a_masked_token():
    logits = torch.tensor([[3.0, 2.0, -1.0, -9.0]])
    u = torch.tensor([1.0 - 2**-53], dtype=torch.float64)
    tokens, logp = sample_tokens(logits, SamplingParams(top_k=2), u)
    assert int(tokens) in (0, 1) and math.isfinite(float(logp))


def test_sequence_uniforms_depend_only_on_seed_and_key():
    both = sequence_uniforms(7, [3, 11], 6)
    alone = sequence_uniforms(7, [11], 6)
    assert torch.equal(both[1], alone[0])
    assert torch.equal(sequence_uniforms(7, [3], 6), sequence_uniforms(7, [3], 6))
    assert not torch.equal(sequence_uniforms(8, [3], 6), both[:1])
    assert bool(((both >= 0) & (both < 1)).all())


def test_sequence_seed_spreads_nearby_inputs():
    seeds = {sequence_seed(s, k) for s in range(20) for k in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**63 for s in seeds)
