"""Training batches generated ahead of the trainer: rollout.mode one_step_off and async.

Step k+1 (the trainer at weight version k) trains on batch J(k+1). When the trainer takes J(k+1),
the pipeline keeps the next `depth` batches J(k+2) .. J(k+1+depth) submitted, so the rollout
engine generates them while step k+1 trains. J(s) trains from version s-1, so its job carries
`min_version = s-1 - max_staleness`: the engine starts it only with weights at least that new,
and no token it generates is more than `max_staleness` versions older than the weights that
train on it ("never started" rather than dropped).

No batch barrier: before the trainer waits for J(k+1), the pipeline already submits the batches
beyond it (up to `depth` of them) that the engine may start with the weights it holds
(min_version <= k), so while J(k+1)'s last responses or episodes finish (an episode waiting on
its tools), the next batch generates: with one_step_off, J(k+2) (min_version k); with async,
J(k+2) is in flight already and J(k+3) joins when max_staleness >= 2. A batch that would wait
for weights not trained yet is submitted after the wait, as before. So at most `depth` + 1
batches are in flight while the trainer waits, `depth` while it trains; the engine starts the
jobs it can (the generator process: a job waiting for newer weights holds up none that can
start, and the oldest batch's go first).

The sampler draws each batch's prompts when the batch is submitted, in step order, with the
seeds a synchronous run would use for that step. A checkpoint records the sampler as it was
before the oldest batch still in flight and the batches in flight with what the engine has
generated of them (`in_flight`, rollout/inflight.py); a resumed run draws those prompts again
and continues each batch from its record (`restore`): complete samples are kept, partial ones
go on from their tokens, so nothing generated before the checkpoint is generated again.

With an environment (`episodes`), each batch is a batch of episodes run by a thread of its own
on rank 0 (rollout/episodes.py: every turn a job of the engine under the batch's
`min_version`), so the episodes of every batch in flight go at their own pace together, each
batch with at most env.max_concurrent_turns turns in flight.
A checkpoint records such a batch as not started: an environment's state is not in the
checkpoint, so a resumed run generates the batch's episodes again from their first turn
(their `async/restored_tokens` is 0).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gspo_megatron.data.dataset import Prompt
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.ranks import Ranks
from gspo_megatron.rollout.base import JobProgress, RolloutSample, SamplingParams
from gspo_megatron.rollout.driver import RolloutDriver, Submitted
from gspo_megatron.rollout.inflight import InFlightBatch

if TYPE_CHECKING:
    from gspo_megatron.rollout.episodes import EpisodeRunner


@dataclass
class _Ahead:
    step: int  # the trainer's step count when this batch trains (it trains step `step` + 1)
    prompts: list[Prompt]
    submitted: Submitted
    sampler_before: dict
    restored_tokens: int = 0  # tokens it had at the checkpoint it was restored from


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
        episodes: EpisodeRunner | None = None,
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
        self.episodes = episodes
        self.ahead: deque[_Ahead] = deque()

    def take(self, step: int) -> tuple[list[Prompt], list[list[RolloutSample]], dict[str, float]]:
        """The prompts and samples that train step `step` + 1, and the pipeline's metrics."""
        if self.ahead and self.ahead[0].step != step:
            raise RuntimeError(f"rollout pipeline holds step {self.ahead[0].step}, not {step}")
        if not self.ahead:
            self._submit(step)
        head = self.ahead[0]
        ready = sum(1 for a in self.ahead if a.submitted.job is not None and a.submitted.job.done())
        self._submit_startable(step)
        waited = time.perf_counter()
        groups = self.driver.collect(head.submitted)
        stats = {"time/rollout_wait": time.perf_counter() - waited}
        self.ahead.popleft()
        job = head.submitted.job
        job_stats = getattr(job, "job_stats", None) if self.ranks.rank == 0 else None
        job_stats, ready, restored = self.ranks.broadcast(
            (job_stats, ready, head.restored_tokens) if self.ranks.rank == 0 else None
        )
        stats["async/queue_ready"] = float(ready)
        stats["async/restored_tokens"] = float(restored)
        if job_stats is not None:
            stats["time/generator_idle"] = job_stats.idle_s
            stats["time/generator_weights_wait"] = job_stats.weights_wait_s
            stats["time/generator_generate"] = job_stats.generate_s
            stats["async/weight_swaps"] = float(job_stats.weight_swaps)
            stats["async/sampled_tokens"] = float(job_stats.sampled_tokens)
        # The next batches generate while this one trains.
        while len(self.ahead) < self.depth:
            self._submit(self.ahead[-1].step + 1 if self.ahead else step + 1)
        stats["async/queue_depth"] = float(len(self.ahead))
        return head.prompts, groups, stats

    def _submit_startable(self, step: int) -> None:
        """Before the trainer waits for batch `step`: submit the next batches, up to `depth`
        beyond it, that the engine may start now (weights of version `step` are there): they
        generate while the batch the trainer waits for finishes its stragglers (no batch
        barrier). One beyond that would wait for weights not trained yet: it is submitted after
        the wait, as before."""
        while len(self.ahead) <= self.depth:
            following = self.ahead[-1].step + 1
            if following - self.max_staleness > step:
                return
            self._submit(following)

    def sampler_state(self) -> dict:
        """The sampler before the oldest batch in flight (what a checkpoint records)."""
        return self.ahead[0].sampler_before if self.ahead else self.sampler.state_dict()

    def abandon(self) -> None:
        """Forget the batches in flight (their results are never used)."""
        for a in self.ahead:
            stop = getattr(a.submitted.job, "cancel_episodes", None)
            if stop is not None:
                stop()
        self.ahead.clear()

    def in_flight(self) -> list[InFlightBatch]:
        """The batches in flight with what the engine has generated of them (rank 0's
        progress; the other ranks' batches hold none), for a checkpoint. Collective."""
        entries = list(self.ahead)
        if self.episodes is not None:  # recorded as not started (the module's docstring)
            progress = None
        else:
            progress = self.driver.snapshot([a.submitted for a in entries])
        out = []
        for i, a in enumerate(entries):
            prompts = [p.prompt_ids for p in a.prompts]
            done = JobProgress.empty(prompts, self.group_size) if progress is None else progress[i]
            out.append(InFlightBatch(a.step, self.params_for(a.step), done))
        return out

    def restore(self, steps: list[int], batches: list[InFlightBatch] | None) -> str | None:
        """After a rewind to the checkpoint's sampler: draw the batches of `steps` that were in
        flight and continue each from its record (`batches`, rank 0's; None on the others).
        Returns why the record cannot be used (the same on every rank; then nothing is
        submitted and the sampler is back where it was), or None. Collective."""
        drawn = []
        for _ in steps:
            before = self.sampler.state_dict()
            drawn.append((before, self.sampler.next_batch()))
        problem = self._mismatch(steps, batches, drawn) if self.ranks.rank == 0 else None
        problem = self.ranks.broadcast(problem)
        if problem is not None:
            if drawn:
                self.sampler.load_state_dict(drawn[0][0])
            return problem
        for i, (step, (before, prompts)) in enumerate(zip(steps, drawn, strict=True)):
            progress = None
            if batches is not None and self.episodes is None:
                progress = self._within_bound(batches[i])
            self._submit_drawn(step, prompts, before, progress)
        return None

    def _mismatch(self, steps: list[int], batches: list[InFlightBatch] | None, drawn) -> str | None:
        """Why the record does not fit this run (its settings, or the prompts drawn again)."""
        if batches is None or [b.step for b in batches] != steps:
            held = [b.step for b in batches or []]
            return f"the record holds the batches of steps {held}, the checkpoint says {steps}"
        if self.ahead or (steps and steps != list(range(steps[0], steps[0] + len(steps)))):
            return f"the batches in flight are not consecutive steps ({steps})"
        for b, (_, prompts) in zip(batches, drawn, strict=True):
            if b.params != self.params_for(b.step):
                return f"batch of step {b.step + 1} was sampled with other settings ({b.params})"
            ids = [[s.prompt_ids for s in g] for g in b.progress.samples]
            want = [[p.prompt_ids] * self.group_size for p in prompts]
            if ids != want:
                return (
                    f"batch of step {b.step + 1}: its prompts or rollout.group_size differ from "
                    "this run's (data, data.seed or the group size changed)"
                )
        return None

    def _within_bound(self, batch: InFlightBatch) -> JobProgress:
        """A group holding a token already past rollout.max_staleness (a lower bound on resume)
        is not continued: it is dropped and counted when taken, as in a live run."""
        progress = batch.progress
        for group, flags in zip(progress.samples, progress.done, strict=True):
            lags = [batch.step - v for s in group for v in s.versions()]
            if lags and max(lags) > self.max_staleness:
                flags[:] = [True] * len(flags)
        return progress

    def _submit(self, step: int) -> None:
        before = self.sampler.state_dict()
        self._submit_drawn(step, self.sampler.next_batch(), before, None)

    def _submit_drawn(
        self, step: int, prompts: list[Prompt], before: dict, progress: JobProgress | None
    ) -> None:
        min_version = max(step - self.max_staleness, 0)
        if self.episodes is not None:
            submitted = self.episodes.submit(
                self.driver, prompts, self.group_size, self.params_for(step),
                min_version=min_version,
            )  # fmt: skip
        else:
            submitted = self.driver.submit(
                [p.prompt_ids for p in prompts],
                self.group_size,
                self.params_for(step),
                min_version=min_version,
                progress=progress,
            )
        restored = progress.tokens() if progress is not None else 0
        self.ahead.append(_Ahead(step, prompts, submitted, before, restored))
