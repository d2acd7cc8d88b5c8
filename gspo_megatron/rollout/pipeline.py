"""Training batches generated ahead of the trainer: rollout.mode one_step_off and async.

Step k+1 (the trainer at weight version k) trains on batch J(k+1). When the trainer takes J(k+1),
the pipeline keeps the next `depth` batches J(k+2) .. J(k+1+depth) submitted, so the rollout
engine generates them while step k+1 trains. J(s) trains from version s-1, so its job carries
`min_version = s-1 - max_staleness`: the engine starts it only with weights at least that new,
and no token it generates is more than `max_staleness` versions older than the weights that
train on it ("never started" rather than dropped).

The sampler draws each batch's prompts when the batch is submitted, in step order, with the
seeds a synchronous run would use for that step. A checkpoint records the sampler as it was
before the oldest batch still in flight: a resumed run draws those prompts again and generates
them anew (with the resumed weights).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gspo_megatron.data.dataset import Prompt
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.ranks import Ranks
from gspo_megatron.rollout.base import RolloutSample, SamplingParams
from gspo_megatron.rollout.driver import RolloutDriver, Submitted


@dataclass
class _Ahead:
    step: int  # the trainer's step count when this batch trains (it trains step `step` + 1)
    prompts: list[Prompt]
    submitted: Submitted
    sampler_before: dict


class RolloutPipeline:
    def __init__(
        self,
        driver: RolloutDriver,
        sampler: PromptSampler,
        ranks: Ranks,
        *,
        depth: int,
        max_staleness: int,
        group_size: int,
        params_for: Callable[[int], SamplingParams],
    ) -> None:
        if depth < 1:
            raise ValueError(f"a rollout pipeline needs depth >= 1, got {depth}")
        self.driver = driver
        self.sampler = sampler
        self.ranks = ranks
        self.depth = depth
        self.max_staleness = max_staleness
        self.group_size = group_size
        self.params_for = params_for
        self.ahead: deque[_Ahead] = deque()

    def take(self, step: int) -> tuple[list[Prompt], list[list[RolloutSample]], dict[str, float]]:
        """The prompts and samples that train step `step` + 1, and the pipeline's metrics."""
        if self.ahead and self.ahead[0].step != step:
            raise RuntimeError(f"rollout pipeline holds step {self.ahead[0].step}, not {step}")
        if not self.ahead:
            self._submit(step)
        head = self.ahead[0]
        ready = sum(1 for a in self.ahead if a.submitted.job is not None and a.submitted.job.done())
        waited = time.perf_counter()
        groups = self.driver.collect(head.submitted)
        stats = {"time/rollout_wait": time.perf_counter() - waited}
        self.ahead.popleft()
        job = head.submitted.job
        job_stats = getattr(job, "job_stats", None) if self.ranks.rank == 0 else None
        job_stats, ready = self.ranks.broadcast(
            (job_stats, ready) if self.ranks.rank == 0 else None
        )
        stats["async/queue_ready"] = float(ready)
        if job_stats is not None:
            stats["time/generator_idle"] = job_stats.idle_s
            stats["time/generator_weights_wait"] = job_stats.weights_wait_s
            stats["time/generator_generate"] = job_stats.generate_s
            stats["async/weight_swaps"] = float(job_stats.weight_swaps)
        # The next batches generate while this one trains.
        while len(self.ahead) < self.depth:
            self._submit(self.ahead[-1].step + 1 if self.ahead else step + 1)
        stats["async/queue_depth"] = float(len(self.ahead))
        return head.prompts, groups, stats

    def sampler_state(self) -> dict:
        """The sampler before the oldest batch in flight (what a checkpoint records)."""
        return self.ahead[0].sampler_before if self.ahead else self.sampler.state_dict()

    def abandon(self) -> None:
        """Forget the batches in flight (their results are never used)."""
        self.ahead.clear()

    def _submit(self, step: int) -> None:
        before = self.sampler.state_dict()
        prompts = self.sampler.next_batch()
        submitted = self.driver.submit(
            [p.prompt_ids for p in prompts],
            self.group_size,
            self.params_for(step),
            min_version=max(step - self.max_staleness, 0),
        )
        self.ahead.append(_Ahead(step, prompts, submitted, before))
