"""Packed (THD) attention as buckets of padded rows (batch.attention_buckets, the plan that
build_microbatch attaches, LocalCoreAttention._packed_rows) against a float64 per-sequence
reference and against the block-diagonal masked path: outputs and gradients."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from gspo_megatron.megatron.attention import LocalCoreAttention  # noqa: E402
from gspo_megatron.megatron.batch import (  # noqa: E402
    ATTENTION_CALL_PAIRS,
    attention_buckets,
    build_microbatch,
)
from gspo_megatron.megatron.training_engine import _packed_seq_params  # noqa: E402
from gspo_megatron.spec.sample import TrainSample  # noqa: E402


def bucket_cost(lengths: list[int], groups: list[list[int]]) -> int:
    return sum(len(g) * max(lengths[i] for i in g) ** 2 + ATTENTION_CALL_PAIRS for g in groups)


def test_uniform_lengths_make_one_bucket_and_long_tails_several():
    assert attention_buckets([7, 7, 7, 7]) == [[0, 1, 2, 3]]
    short = [random.Random(0).randint(6, 14) for _ in range(128)]  # bench_vs_trl's lengths
    assert len(attention_buckets(short)) == 1
    tail = [16] * 60 + [40] * 20 + [256] * 3
    groups = attention_buckets(tail)
    assert len(groups) > 1
    assert sorted(i for g in groups for i in g) == list(range(len(tail)))
    assert [max(tail[i] for i in g) for g in groups] == sorted(
        (max(tail[i] for i in g) for g in groups), reverse=True
    )


def test_buckets_are_the_cheapest_split_of_the_sorted_lengths():
    """Against every split of the length-sorted sequences into consecutive groups."""
    rng = random.Random(1)
    for _ in range(30):
        lengths = [rng.choice([2, 3, 5, 30, 64, 65, 90, 200]) for _ in range(rng.randint(1, 9))]
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        splits = (
            [order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))]
            for k in range(len(order))
            for cuts in itertools.combinations(range(1, len(order)), k)
        )
        best = min(bucket_cost(lengths, groups) for groups in splits)
        assert bucket_cost(lengths, attention_buckets(lengths)) == best


def attention(heads: int, groups: int, head_dim: int) -> LocalCoreAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    return LocalCoreAttention(
        config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=None)
    )


@pytest.mark.parametrize("lengths", [[5, 5, 5, 5], [3, 1, 17, 4, 60, 9, 2, 33], [300, 2, 7]])
def test_packed_rows_match_each_sequence_attended_alone(lengths):
    torch.manual_seed(0)
    heads, groups, head_dim = 4, 2, 8
    samples = [TrainSample([1] * (n - n // 2), [2] * (n // 2), advantage=0.0) for n in lengths]
    mb = build_microbatch(samples, list(range(len(samples))), multiple=1, packed=True)
    assert mb.seq_lengths.tolist() == lengths and mb.attention_shapes
    rows_params = _packed_seq_params(mb)
    mask_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, requires_grad=True)
    k = torch.randn(total, groups, head_dim, requires_grad=True)
    v = torch.randn(total, groups, head_dim, requires_grad=True)
    grad_out = torch.randn(total, heads * head_dim)
    core = attention(heads, groups, head_dim)

    def run(params, dtype=torch.float32):
        qi, ki, vi = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        if params is None:  # each sequence alone, causally
            outs, start = [], 0
            for n in lengths:
                s = slice(start, start + n)
                outs.append(core._attend(qi[s, None], ki[s, None], vi[s, None], None)[:, 0])
                start += n
            out = torch.cat(outs)
        else:
            # megatron reshapes THD outputs to [t, 1, heads * d]
            out = core(qi, ki, vi, None, packed_seq_params=params).reshape(total, -1)
        out.backward(grad_out.to(dtype))
        return [t.double() for t in (out, qi.grad, ki.grad, vi.grad)]

    reference = run(None, torch.float64)
    rows, masked, alone = run(rows_params), run(mask_params), run(None)
    # The slots past a sequence's end hold copies of token 0: any gradient they sent it would
    # show in its k and v gradients against the per-sequence float32 run.
    for got, want, masked_got, alone_got in zip(rows, reference, masked, alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got, masked_got, atol=1e-6, rtol=0)
        torch.testing.assert_close(got, alone_got, atol=1e-6, rtol=0)
