"""Per-turn credit (algorithms/advantages.py) against an independent float64 reference: the
discounted reward-to-go of each model turn, its baseline over the episodes of the same group at
the same turn index, and the broadcast to each turn's tokens."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gspo_megatron.algorithms import (
    group_advantages,
    turn_advantages,
    turn_end_rewards,
    turn_returns,
    turn_token_advantages,
)


def reference(episodes, groups, gamma, normalize_std, eps, unbiased):
    """Plain Python, float64: episodes[b] is the list of turn rewards of episode b."""
    returns = []
    for rewards in episodes:
        g = []
        for k in range(len(rewards)):
            g.append(sum(gamma ** (j - k) * rewards[j] for j in range(k, len(rewards))))
        returns.append(g)
    cells: dict[tuple[int, int], list[float]] = {}
    for b, g in enumerate(returns):
        for k, value in enumerate(g):
            cells.setdefault((groups[b], k), []).append(value)
    out = []
    for b, g in enumerate(returns):
        row = []
        for k, value in enumerate(g):
            peers = cells[(groups[b], k)]
            mean = math.fsum(peers) / len(peers)
            centered = value - mean
            if normalize_std:
                n = len(peers)
                denom = max(n - 1, 1) if unbiased else n
                std = math.sqrt(math.fsum((x - mean) ** 2 for x in peers) / denom)
                centered /= std + eps
            row.append(centered)
        out.append(row)
    return returns, out


def padded(episodes):
    turns = max(len(e) for e in episodes)
    rewards = torch.full((len(episodes), turns), float("nan"), dtype=torch.float64)
    mask = torch.zeros(len(episodes), turns, dtype=torch.bool)
    for b, e in enumerate(episodes):
        rewards[b, : len(e)] = torch.tensor(e, dtype=torch.float64)
        mask[b, : len(e)] = True
    return rewards, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize(
    ("normalize_std", "unbiased"), [(True, True), (True, False), (False, True)]
)
def test_turn_advantages_match_a_float64_reference(seed, gamma, normalize_std, unbiased):
    rng = random.Random(seed)
    groups, episodes = [], []
    for group in rng.sample(range(100), 5):  # group ids in any order and any values
        for _ in range(rng.randint(1, 6)):
            groups.append(group)
            episodes.append(
                [rng.choice([0.0, 1.0, -0.5, rng.gauss(0, 1)]) for _ in range(rng.randint(1, 5))]
            )
    order = list(range(len(groups)))
    rng.shuffle(order)  # episodes of a group need not be adjacent
    groups = [groups[i] for i in order]
    episodes = [episodes[i] for i in order]
    rewards, mask = padded(episodes)
    want_returns, want = reference(episodes, groups, gamma, normalize_std, 1e-6, unbiased)

    got_returns = turn_returns(rewards, mask, gamma)
    got = turn_advantages(
        rewards, mask, torch.tensor(groups), gamma,
        normalize_std=normalize_std, eps=1e-6, unbiased=unbiased,
    )  # fmt: skip
    assert got.dtype == torch.float64
    for b, e in enumerate(episodes):
        n = len(e)
        assert got_returns[b, :n].tolist() == pytest.approx(want_returns[b], rel=1e-12, abs=1e-12)
        assert got[b, :n].tolist() == pytest.approx(want[b], rel=1e-10, abs=1e-12)
        assert (got[b, n:] == 0).all() and (got_returns[b, n:] == 0).all()


def test_undiscounted_first_turn_is_the_episode_advantage():
    rng = random.Random(7)
    episodes = [[rng.gauss(0, 1) for _ in range(rng.randint(1, 4))] for _ in range(12)]
    groups = [i // 4 for i in range(12)]
    rewards, mask = padded(episodes)
    first = turn_advantages(rewards, mask, torch.tensor(groups), 1.0)[:, 0]
    totals = torch.tensor([sum(e) for e in episodes], dtype=torch.float64)
    episode = group_advantages(totals.view(3, 4)).flatten()
    torch.testing.assert_close(first, episode, rtol=1e-10, atol=1e-12)


def test_tokens_get_their_turn_advantage():
    advantages = torch.tensor([[1.0, -2.0, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    token_turns = torch.tensor([[0, 0, -1, -1, 1, 1, -1], [0, 0, 0, -1, -1, -1, -1]])
    got = turn_token_advantages(advantages, token_turns)
    assert got.tolist() == [[1, 1, 0, 0, -2, -2, 0], [0.5, 0.5, 0.5, 0, 0, 0, 0]]
    ends = turn_end_rewards(torch.tensor([[3.0, 4.0], [5.0, 0.0]]), token_turns)
    assert ends.tolist() == [[0, 3, 0, 0, 0, 4, 0], [0, 0, 5, 0, 0, 0, 0]]
    # with a mask, on the last trained token at or before the turn's end; a turn with no
    # trained token before its end drops its reward (no trained token precedes it)
    mask = torch.tensor([[1, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0]])
    ends = turn_end_rewards(torch.tensor([[3.0, 4.0], [5.0, 0.0]]), token_turns, mask)
    assert ends.tolist() == [[3, 0, 0, 0, 0, 4, 0], [0] * 7]
    mask = torch.tensor([[0, 0, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]])
    ends = turn_end_rewards(torch.tensor([[3.0, 4.0], [5.0, 0.0]]), token_turns, mask)
    assert ends.tolist() == [[0, 0, 0, 0, 4, 0, 0], [0, 0, 5, 0, 0, 0, 0]]
    # two turns with no observation between them still end separately
    assert turn_end_rewards(torch.tensor([[3.0, 4.0]]), torch.tensor([[0, 1, 1]])).tolist() == [
        [3, 0, 4]
    ]


def test_bad_inputs_are_refused_by_name():
    rewards = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, True], [True, True, False]])
    with pytest.raises(ValueError, match="no hole"):
        turn_returns(rewards, mask, 1.0)
    ok = torch.tensor([[True, True, False], [True, False, False]])
    with pytest.raises(ValueError, match="gamma must be in"):
        turn_returns(rewards, ok, 1.5)
    with pytest.raises(ValueError, match="finite"):
        turn_returns(torch.tensor([[float("inf"), 0.0, 0.0], [0.0, 0.0, 0.0]]), ok, 1.0)
    with pytest.raises(ValueError, match="integer"):
        turn_advantages(rewards, ok, torch.tensor([0.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="turn index below 3"):
        turn_token_advantages(rewards, torch.tensor([[0, 3], [0, 0]]))
