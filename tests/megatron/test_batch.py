"""Micro-batch planning and layouts (gspo_megatron/megatron/batch.py), without megatron: the
token-balanced packed plan, equal micro-batch counts on every data-parallel rank, and the packed
(THD) and padded layouts of the same sequences, split for context parallelism."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gspo_megatron.algorithms.losses import denominator_count, get_policy_loss
from gspo_megatron.megatron.batch import (
    assemble_cp_rows,
    build_microbatch,
    denominator_of,
    karmarkar_karp,
    plan_packed,
    plan_padded,
)
from gspo_megatron.spec.sample import TrainSample


def long_tailed_lengths(count: int, seed: int = 0, median: int = 64) -> list[int]:
    """Lognormal lengths with the longest about 16x the median (as in benchmarks/bench_packing)."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.normal(np.log(median), 1.0, size=count))
    return [int(x) for x in np.clip(lengths, 2, 16 * median)]


def test_karmarkar_karp_partitions_every_index_once_into_balanced_groups():
    lengths = long_tailed_lengths(512)
    for parts in (2, 8, 64):
        groups = karmarkar_karp(lengths, parts)
        assert len(groups) == parts and all(groups)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        sums = [sum(lengths[i] for i in g) for g in groups]
        # Far from perfect balance only when one sequence outweighs a fair share.
        assert max(sums) <= max(sum(sums) / parts * 1.02, max(lengths))


def test_karmarkar_karp_is_the_largest_differencing_method():
    # Differencing 8,7,6,5,4 leaves 2 (the optimum is 0: 8+7 | 6+5+4), the method's textbook case.
    costs = [8, 7, 6, 5, 4]
    sums = sorted(sum(costs[i] for i in g) for g in karmarkar_karp(costs, 2))
    assert sums == [14, 16]
    assert karmarkar_karp([5, 1, 1], 3) == [[0], [1], [2]]


@pytest.mark.parametrize("dp, count_multiple", [(1, 1), (4, 1), (8, 1), (2, 2)])
def test_packed_plan_fills_every_rank_alike_within_the_budget(dp, count_multiple):
    lengths = long_tailed_lengths(256, seed=dp)
    budget = 2048
    plans = plan_packed(lengths, dp, budget, count_multiple)
    counts = {len(plan) for plan in plans}
    assert len(counts) == 1 and counts.pop() % count_multiple == 0
    assert sorted(i for plan in plans for g in plan for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= budget for plan in plans for g in plan)
    # The fewest micro-batches the budget allows, or one more where balance needs it.
    fewest = -(-sum(lengths) // (dp * budget))
    assert len(plans[0]) <= -(-(fewest + 1) // count_multiple) * count_multiple
    per_rank = [sum(lengths[i] for g in plan for i in g) for plan in plans]
    assert max(per_rank) / (sum(per_rank) / dp) <= 1.05


def test_packed_plan_refuses_a_sequence_over_the_budget_naming_both_numbers():
    with pytest.raises(
        ValueError, match=r"a sequence of 300 tokens .*engine\.max_tokens_per_microbatch=256"
    ):
        plan_packed([10, 300, 20], 1, 256)


def test_plans_refuse_too_few_sequences_for_the_ranks():
    with pytest.raises(ValueError, match="3 sequences cannot fill 1 micro-batch"):
        plan_packed([10, 20, 30], 4, 100)
    with pytest.raises(ValueError, match="a multiple of parallel.pp=2"):
        plan_padded([10, 20], 2, 1000, 1, count_multiple=2)


def test_padded_plan_gives_every_rank_the_same_number_of_microbatches():
    # Greedy balance: rank 0 gets 40 and 10, two padded micro-batches within 40 tokens; rank 1
    # four 10s, one micro-batch, which it splits: expert and pipeline collectives need the same
    # count on every rank.
    lengths = [40] + [10] * 5
    plans = plan_padded(lengths, 2, 40, 1)
    assert [len(p) for p in plans] == [2, 2]
    assert sorted(i for plan in plans for g in plan for i in g) == list(range(6))
    # With one sequence fewer rank 0 holds 40 alone and cannot match rank 1's two.
    with pytest.raises(ValueError, match=r"needs 2 micro-batch\(es\); one has only 1 sequence"):
        plan_padded([40] + [10] * 4, 2, 30, 1)


def samples_of(lengths: list[tuple[int, int]], seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for prompt_len, response_len in lengths:
        out.append(
            TrainSample(
                [rng.randrange(1, 50) for _ in range(prompt_len)],
                [rng.randrange(1, 50) for _ in range(response_len)],
                advantage=rng.gauss(0, 1),
                old_logprobs=[-rng.random() for _ in range(response_len)],
                routed_experts=np.array(
                    [
                        [[rng.randrange(8), 8 + rng.randrange(8)]] * 2
                        for _ in range(prompt_len + response_len - 1)
                    ],
                    dtype=np.int16,
                ),
            )
        )
    return out


@pytest.mark.parametrize("cp, multiple", [(1, 1), (1, 2), (2, 4), (2, 8), (4, 8)])
def test_packed_layout_holds_the_padded_rows_on_every_cp_rank(cp, multiple):
    samples = samples_of([(3, 5), (2, 1), (6, 9), (4, 4)])
    indices = [2, 0, 3, 1]
    padded = build_microbatch(samples, indices, multiple=multiple)  # cp=1: the whole rows
    per_rank = [
        build_microbatch(samples, indices, multiple=multiple, cp_size=cp, cp_rank=r, packed=True)
        for r in range(cp)
    ]
    first = per_rank[0]
    total = int(first.cu_seqlens[-1])
    assert total % multiple == 0
    assert first.tokens.shape == (1, total // cp)
    lengths = first.seq_lengths.tolist()
    assert all(n % (2 * cp if cp > 1 else 1) == 0 for n in lengths)
    assert first.cu_seqlens.tolist() == np.cumsum([0] + lengths).tolist()
    # Padding is at most what CP and the total's multiple need.
    real = sum(samples[i].length for i in indices)
    assert total - real < len(indices) * (2 * cp if cp > 1 else 1) + multiple
    # Model layout, back in rows: position ids restart in every sequence as the padded rows' do.
    for name in ("tokens", "labels", "has_label", "position_ids", "routed_experts"):
        rows = assemble_cp_rows([mb.rows(getattr(mb, name)) for mb in per_rank], lengths)
        expected = getattr(padded, name)
        for row, s in enumerate(samples[i] for i in indices):
            n = s.length
            assert torch.equal(rows[row, :n], expected[row, :n]), name
    for name in ("loss_mask", "old_logprobs"):
        rows = assemble_cp_rows([getattr(mb, name) for mb in per_rank], lengths)
        for row, s in enumerate(samples[i] for i in indices):
            assert torch.equal(rows[row, : s.length], getattr(padded, name)[row, : s.length])
    assert first.max_seqlen == max(lengths)
    assert torch.equal(padded.advantages, first.advantages)


@pytest.mark.parametrize("name", ["gspo", "ppo"])  # D counts sequences, then tokens
def test_denominator_of_equals_denominator_count_of_the_response_mask(name):
    """The engine's D, counted from the samples' lists, equals `denominator_count` of their
    response mask built as a float32 tensor: masks absent, all zero, below float32's range
    (rounded to 0), NaN and negative."""
    rng = random.Random(3)
    special = [0.0, 1.0, 1e-50, -0.5, float("nan"), 2.0**-149]
    samples = []
    for i in range(40):
        n = rng.randint(1, 6)
        mask = None
        if i % 5:
            mask = [rng.choice(special) if rng.random() < 0.6 else 0.0 for _ in range(n)]
        samples.append(TrainSample(prompt_ids=[1], response_ids=[2] * n, loss_mask=mask))
    width = max(len(s.response_ids) for s in samples)
    rows = torch.zeros(len(samples), width)
    for row, s in zip(rows, samples, strict=True):
        n = len(s.response_ids)
        row[:n] = torch.ones(n) if s.loss_mask is None else torch.tensor(s.loss_mask)
    want = int(denominator_count(name, rows))
    per_token = get_policy_loss(name).denominator == "tokens"
    assert denominator_of(samples, per_token) == want
    assert denominator_of(samples[:1], per_token) == int(denominator_count(name, rows[:1]))
