"""Deterministic, resumable prompt sampling.

The sampler walks an endless stream: epoch 0's permutation of the data set, then epoch 1's, and
so on, each permutation a pure function of (seed, epoch). A batch may cross an epoch boundary,
so every prompt is drawn exactly once per epoch and no prompt is ever dropped. The position is
(epoch, offset into that epoch); `state_dict()` / `load_state_dict()` save and restore it, so a
resumed run draws exactly the prompts the uninterrupted run would have drawn.

    sampler = PromptSampler(dataset, batch_size=32, seed=0)
    batch = sampler.next_batch()     # list[Prompt]
    more = sampler.take(8)           # any number, e.g. to refill after dynamic sampling
    ckpt["sampler"] = sampler.state_dict()
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gspo_megatron.data.dataset import Prompt

_STATE_VERSION = 1


class PromptSampler:
    """Batches of prompts in a seeded per-epoch order, with a resumable position.

    Args:
        dataset: the prompts (any sequence of `Prompt`).
        batch_size: prompts per `next_batch()`.
        seed: shuffling seed; permutation of epoch e = numpy Generator seeded by (seed, e).
        shuffle: False walks the data set in order every epoch.
    """

    def __init__(
        self, dataset: Sequence[Prompt], batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("cannot sample from an empty prompt data set")
        if batch_size < 1:
            raise ValueError(f"sampler batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def consumed(self) -> int:
        """Prompts drawn so far, over all epochs."""
        return self.epoch * len(self.dataset) + self.offset

    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts of the stream (crossing into the next epoch if needed)."""
        out: list[Prompt] = []
        while len(out) < n:
            k = min(n - len(out), len(self._order) - self.offset)
            out.extend(self.dataset[int(i)] for i in self._order[self.offset : self.offset + k])
            self.offset += k
            if self.offset == len(self._order):  # keep offset < len: the state reads naturally
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
        return out

    def next_batch(self) -> list[Prompt]:
        return self.take(self.batch_size)

    def __iter__(self) -> Iterator[list[Prompt]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the data set, seed and shuffle must be the saved ones."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')}, expected 1")
        if state["num_prompts"] != len(self.dataset):
            raise ValueError(
                f"sampler state was saved for {state['num_prompts']} prompts, the data set now "
                f"has {len(self.dataset)}: the data or its filters (max_prompt_length, fields) "
                "changed; restore them, or resume without the sampler state"
            )
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(
                f"sampler state was saved with seed={state['seed']} shuffle={state['shuffle']}, "
                f"this run has seed={self.seed} shuffle={self.shuffle}: set data.seed / "
                "data.shuffle to the saved values, or resume without the sampler state"
            )
        if not 0 <= state["offset"] < state["num_prompts"] or state["epoch"] < 0:
            raise ValueError(f"sampler state position is invalid: {state}")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._permutation(self.epoch)
