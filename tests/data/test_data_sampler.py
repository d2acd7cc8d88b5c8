"""PromptSampler: seeded per-epoch order, every prompt once per epoch, exact resumption."""

from __future__ import annotations

import numpy as np
import pytest

from gspo_megatron.data import Prompt, PromptSampler


def _dataset(n: int) -> list[Prompt]:
    return [Prompt(i, [1, 4 + i % 10], str(i), label=str(i)) for i in range(n)]


def _indices(batches) -> list[int]:
    return [p.index for batch in batches for p in batch]


def test_each_epoch_is_a_seeded_permutation():
    ds = _dataset(10)
    sampler = PromptSampler(ds, batch_size=4, seed=7)
    drawn = _indices(sampler.next_batch() for _ in range(5))  # 20 prompts = 2 epochs
    # the order is numpy's permutation seeded by (seed, epoch), checked independently
    expected = [
        *np.random.default_rng([7, 0]).permutation(10),
        *np.random.default_rng([7, 1]).permutation(10),
    ]
    assert drawn == [int(i) for i in expected]
    assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
    assert drawn[:10] != drawn[10:]  # reshuffled per epoch
    assert sampler.epoch == 2 and sampler.offset == 0 and sampler.consumed == 20
    # the third batch crossed the epoch boundary: 2 from epoch 0, 2 from epoch 1
    assert PromptSampler(ds, batch_size=4, seed=7).take(12)[8:] == [ds[i] for i in drawn[8:12]]


def test_same_seed_same_order_other_seed_other_order():
    ds = _dataset(50)
    a = _indices(PromptSampler(ds, 8, seed=1).next_batch() for _ in range(3))
    b = _indices(PromptSampler(ds, 8, seed=1).next_batch() for _ in range(3))
    c = _indices(PromptSampler(ds, 8, seed=2).next_batch() for _ in range(3))
    assert a == b and a != c
    ordered = PromptSampler(ds, 8, shuffle=False)
    assert _indices([ordered.take(60)]) == list(range(50)) + list(range(10))


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_resume_gives_the_identical_continuation(k):
    ds = _dataset(13)
    reference = PromptSampler(ds, batch_size=5, seed=3)
    full = [reference.next_batch() for _ in range(k + 6)]

    first = PromptSampler(ds, batch_size=5, seed=3)
    for _ in range(k):
        first.next_batch()
    state = first.state_dict()
    assert state == {
        "version": 1,
        "seed": 3,
        "shuffle": True,
        "num_prompts": 13,
        "epoch": (5 * k) // 13,
        "offset": (5 * k) % 13,
    }
    resumed = PromptSampler(ds, batch_size=5, seed=3)  # a fresh sampler, as after a restart
    resumed.load_state_dict(dict(state))
    assert [resumed.next_batch() for _ in range(6)] == full[k:]


def test_state_mismatches_are_refused():
    sampler = PromptSampler(_dataset(10), batch_size=2, seed=0)
    sampler.take(3)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="saved for 10 prompts, the data set now has 9"):
        PromptSampler(_dataset(9), batch_size=2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0 .* this run has seed=1"):
        PromptSampler(_dataset(10), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="empty"):
        PromptSampler([], batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(_dataset(3), batch_size=0)
