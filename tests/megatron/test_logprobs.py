"""Chunked vocabulary log-probs and entropy vs a float64 full-vocabulary reference."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from gspo_megatron.megatron.logprobs import vocab_parallel_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
def test_values_and_gradients_match_float64(dtype, chunk_tokens):
    torch.manual_seed(0)
    tokens, padded_vocab, vocab = 37, 64, 50  # rows 50..63 are vocabulary padding
    logits = (3 * torch.randn(tokens, padded_vocab)).to(dtype).requires_grad_(True)
    original = logits.detach().clone()
    targets = torch.randint(0, vocab, (tokens,))
    lp, ent = vocab_parallel_logprobs(
        logits, targets, vocab_size=vocab, chunk_bytes=4 * padded_vocab * chunk_tokens
    )
    ref_logits = logits.detach().double()[:, :vocab].requires_grad_(True)
    ref = torch.log_softmax(ref_logits, dim=-1)
    ref_lp = ref.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    w_lp, w_ent = torch.randn(tokens), torch.randn(tokens)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad(
        (ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum(), ref_logits
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grad[:, :vocab].double(), ref_grad, atol=tol, rtol=0)
    assert torch.all(grad[:, vocab:] == 0)  # padding rows get no gradient
    assert torch.equal(logits.detach(), original)  # the backward never edits the logits


def test_batched_shape_and_no_entropy():
    logits = torch.randn(2, 5, 16, requires_grad=True)
    targets = torch.randint(0, 16, (2, 5))
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=16, with_entropy=False)
    assert lp.shape == (2, 5) and ent is None
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, expected)
