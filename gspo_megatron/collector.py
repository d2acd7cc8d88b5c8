"""Rollouts for the training loop and for the evaluation (docs/ARCHITECTURE.md §3, steps 1-3).

`RolloutCollector` generates through the rollout driver (rank 0 alone drives a server engine),
the pipeline of batches generated ahead (rollout.mode one_step_off / async) or multi-turn
episodes (env.name); admits a batch generated ahead against rollout.max_staleness; scores it
(the rule reward on rank 0, a learned reward model on every rank, episodes' step rewards, DAPO's
soft overlong penalty); applies dynamic sampling (solved-prompt pre-filter, DAPO refill rounds,
DUPO duplication); and reports the rollout metrics. The Trainer takes each step's batch from
`collect`; the evaluation (evaluation/benchmarks.py: in the loop and in gspo-eval) generates
through `groups` and reads responses with `response_text`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from gspo_megatron.algorithms import (
    dapo_keep_indices,
    dupo_fill_indices,
    prefilter_solved_prompts,
    rollout_metrics,
    soft_overlong_penalty,
)
from gspo_megatron.checkpoint.meta import CheckpointError
from gspo_megatron.data.dataset import Prompt
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.notes import note
from gspo_megatron.ranks import Ranks
from gspo_megatron.rollout.base import RolloutSample, SamplingParams, response_text
from gspo_megatron.rollout.driver import RolloutDriver
from gspo_megatron.rollout.episodes import EpisodeRunner, episode_rewards
from gspo_megatron.rollout.inflight import InFlightError, from_payload, summary, to_payload
from gspo_megatron.rollout.pipeline import RolloutPipeline
from gspo_megatron.spec.sample import TrainSample

if TYPE_CHECKING:
    from gspo_megatron.config import RunConfig


@dataclass
class RolloutBatch:
    """One step's groups: G responses per prompt, with their rewards; the step's inputs add the
    advantages and the samples to train on (step_inputs.py)."""

    prompts: list[Prompt]
    groups: list[list[RolloutSample]]
    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [groups, G]
    failed_rewards: int = 0  # reward calls that raised or timed out
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [groups, G]
    samples: list[TrainSample] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    train_version: int = 0  # the weight version that trains on it (the step before it)

    def flat(self) -> list[RolloutSample]:
        return [s for group in self.groups for s in group]


@dataclass(frozen=True)
class CollectorSettings:
    """What the collector reads of the run's config (`from_config`)."""

    seed: int
    prompts_per_step: int
    group_size: int
    sampling: SamplingParams  # without a seed: each call derives its own
    ahead: int  # batches kept generating ahead (rollout.mode: 0 sync, 1 one_step_off, async)
    max_staleness: int
    prefilter_solved_prompts: bool
    dynamic_sampling: str  # none | dapo | dupo
    max_refill_rounds: int
    overlong_penalty_length: int
    overlong_penalty_cache: int
    rule_weight: float
    model_weight: float

    @classmethod
    def from_config(cls, cfg: RunConfig, stop_token_ids: tuple[int, ...]) -> CollectorSettings:
        r, alg = cfg.rollout, cfg.algorithm
        return cls(
            seed=cfg.seed,
            prompts_per_step=r.prompts_per_step,
            group_size=r.group_size,
            sampling=SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=r.max_new_tokens,
                stop_token_ids=stop_token_ids,
            ),
            ahead={"sync": 0, "one_step_off": 1}.get(r.mode, r.queue_batches),
            max_staleness=r.max_staleness,
            prefilter_solved_prompts=alg.prefilter_solved_prompts,
            dynamic_sampling=alg.dynamic_sampling,
            max_refill_rounds=alg.max_refill_rounds,
            overlong_penalty_length=alg.overlong_penalty_length,
            overlong_penalty_cache=alg.overlong_penalty_cache,
            rule_weight=cfg.reward.rule_weight,
            model_weight=cfg.reward.model_weight,
        )


class RolloutCollector:
    """See the module's docstring. `sampler` and `scorer` are only needed by `collect` (the
    evaluation scores with each benchmark's own scorer); `reward_model` scores on every rank
    (`score(prompts, responses)`: gspo_megatron.megatron.reward_model.RewardModel)."""

    def __init__(
        self,
        settings: CollectorSettings,
        driver: RolloutDriver,
        *,
        ranks: Ranks,
        tokenizer,
        sampler: PromptSampler | None = None,
        scorer=None,
        episodes: EpisodeRunner | None = None,
        reward_model=None,
    ) -> None:
        self.settings = settings
        self.driver = driver
        self.ranks = ranks
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.scorer = scorer
        self.episodes = episodes
        self.reward_model = reward_model
        # Rollbacks so far (stability/rollback.py): each draws the seeds of a new timeline.
        self.timeline = 0
        self.pipeline = None
        if settings.ahead and sampler is not None:
            self.pipeline = RolloutPipeline(
                driver,
                sampler,
                ranks,
                depth=settings.ahead,
                max_staleness=settings.max_staleness,
                group_size=settings.group_size,
                params_for=lambda step: self.sampling_params(step, 0),
                episodes=episodes,
            )

    @classmethod
    def for_run(
        cls, cfg: RunConfig, engine, *, weight_source, ranks: Ranks, tokenizer, **parts
    ) -> RolloutCollector:
        """A collector over `engine` as the run's config sets it up; `parts`: train_data (the
        prompts `collect` draws from), scorer, reward_model."""
        train_data = parts.pop("train_data", None)
        sampler = None
        if train_data is not None:
            sampler = PromptSampler(
                train_data,
                cfg.rollout.prompts_per_step,
                seed=cfg.seed + cfg.data.seed,
                shuffle=cfg.data.shuffle,
            )
        episodes = None
        if cfg.env.enabled:
            episodes = EpisodeRunner(cfg.env, tokenizer, ranks, cfg.engine.max_sequence_length)
        stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        return cls(
            CollectorSettings.from_config(cfg, stop),
            RolloutDriver(engine, ranks, weight_source),
            ranks=ranks,
            tokenizer=tokenizer,
            sampler=sampler,
            episodes=episodes,
            **parts,
        )

    # -- generation -------------------------------------------------------------------------

    def groups(
        self, prompts: Sequence[Prompt], n: int, params: SamplingParams, *, now: bool = False
    ) -> list[list[RolloutSample]]:
        """`n` responses per prompt, or `n` episodes with an environment, on every rank. `now`:
        with the current weights, before any batch generated ahead (the evaluation's)."""
        ahead = {}
        if now and self.pipeline is not None:
            ahead = {"min_version": self.driver.version, "urgent": True}
        if self.episodes is not None:
            return self.episodes.run(self.driver, list(prompts), n, params, **ahead)
        return self.driver.generate([p.prompt_ids for p in prompts], n, params, **ahead)

    def response_text(self, sample: RolloutSample) -> str:
        return response_text(sample, self.tokenizer, self.settings.sampling.stop_token_ids)

    def sampling_params(self, step: int, round_: int) -> SamplingParams:
        """Sampling for the batch that trains step `step` + 1 (refill round `round_` of it)."""
        seed = derive_seed(self.settings.seed, step, round_, self.timeline)
        return dataclasses.replace(self.settings.sampling, seed=seed)

    def collect(self, step: int) -> RolloutBatch:
        """The scored rollouts that train step `step` + 1; dynamic sampling fills the batch."""
        s = self.settings
        wanted = s.prompts_per_step
        stats: dict[str, float] = {}
        if self.pipeline is None:
            batch = self._generate(step, self.sampler.next_batch(), round_=0)
        else:
            prompts, groups, stats = self.pipeline.take(step)
            batch = self._admit(step, prompts, groups, stats)
        generated = [batch]
        if s.prefilter_solved_prompts:
            keep = prefilter_solved_prompts(batch.rewards)
            stats["sampling/solved_groups_dropped"] = float((~keep).sum())
            batch = _select(batch, torch.nonzero(keep).flatten())
        if s.dynamic_sampling == "dapo":
            kept = _select(batch, dapo_keep_indices(batch.rewards))
            rounds = 0
            while len(kept.groups) < wanted and rounds < s.max_refill_rounds:
                rounds += 1
                more = self._generate(step, self.sampler.next_batch(), round_=rounds)
                generated.append(more)
                more = _select(more, dapo_keep_indices(more.rewards))
                kept = _concat(kept, more)
            stats["sampling/refill_rounds"] = float(rounds)
            batch = _select(kept, torch.arange(min(wanted, len(kept.groups))))
        elif s.dynamic_sampling == "dupo":
            generator = torch.Generator().manual_seed(
                s.seed * 7919 + step + self.timeline * 15_485_863
            )
            fill = dupo_fill_indices(batch.rewards, num_groups=wanted, generator=generator)
            batch = _select(batch, fill)  # empty when no group is informative, as with DAPO
        self.driver.release_kept_context()  # before training needs the memory
        stats.update(_generation_metrics(generated))
        if self.episodes is not None:
            stats["time/env"] = self.episodes.take_env_time()
        stats["sampling/groups_used"] = float(len(batch.groups))
        batch.stats.update(stats)
        batch.train_version = step
        return batch

    def _generate(self, step: int, prompts: list[Prompt], round_: int) -> RolloutBatch:
        params = self.sampling_params(step, round_)
        groups = self.groups(prompts, self.settings.group_size, params)
        batch = RolloutBatch(prompts=list(prompts), groups=groups)
        batch.rewards = self.score(batch)
        return batch

    def _admit(
        self,
        step: int,
        prompts: list[Prompt],
        groups: list[list[RolloutSample]],
        stats: dict[str, float],
    ) -> RolloutBatch:
        """A batch generated ahead, checked against the staleness bound and scored.

        A group holding a token sampled more than rollout.max_staleness versions before the
        weights that train on it (`step`) is dropped and counted; the pipeline starts no batch
        that could produce one, so a drop means an engine broke the bound.
        """
        bound = self.settings.max_staleness
        lags = [[step - v for s in group for v in s.versions()] or [0] for group in groups]
        kept = [i for i, lag in enumerate(lags) if max(lag) <= bound]
        dropped = sum(len(g) for g in groups) - sum(len(groups[i]) for i in kept)
        if dropped:
            note(
                f"step {step + 1}: {dropped} samples older than "
                f"rollout.max_staleness={bound} dropped"
            )
        tokens = [x for i in kept for x in lags[i]]
        stats["async/dropped_samples"] = float(dropped)
        stats["async/staleness_mean"] = float(np.mean(tokens)) if tokens else 0.0
        stats["async/staleness_max"] = float(max(tokens, default=0))
        stats["async/partial_responses"] = float(
            sum(len(set(s.versions())) > 1 for i in kept for s in groups[i])
        )
        batch = RolloutBatch(prompts=[prompts[i] for i in kept], groups=[groups[i] for i in kept])
        batch.rewards = self.score(batch)
        batch.stats.update(stats)
        return batch

    # -- rewards ----------------------------------------------------------------------------

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """Rewards [groups, G] (+ DAPO's soft overlong penalty); the rule reward scored on rank
        0, the reward model on every rank."""
        flat = batch.flat()
        prompts = [p.prompt for p, g in zip(batch.prompts, batch.groups, strict=True) for _ in g]
        labels = [p.label for p, g in zip(batch.prompts, batch.groups, strict=True) for _ in g]
        texts = [self.response_text(s) for s in flat]
        payload = None
        if self.ranks.rank == 0:
            scored = self.scorer.score(prompts, texts, labels)
            payload = (scored.rewards, scored.metrics(prefix="reward/"))
        payload = self.ranks.broadcast(payload)
        # [groups, G]; a batch whose every group was dropped (the staleness bound) has none
        rewards = torch.tensor(payload[0], dtype=torch.float32).view(
            len(batch.groups), self.settings.group_size if not flat else -1
        )
        stats = dict(payload[1])
        batch.failed_rewards = int(stats["reward/failures"] + stats["reward/timeouts"])
        if self.episodes is not None:
            rewards, failed = episode_rewards(rewards, flat)
            batch.failed_rewards += failed
        if self.reward_model is not None:
            rewards = self._with_model_scores(rewards, flat, stats)
        if "reward/time_s" in stats:
            stats["time/score"] = stats.pop("reward/time_s")
        batch.stats.update(stats)
        s = self.settings
        if s.overlong_penalty_length:
            # what the policy generated: an episode's observations do not count
            lengths = torch.tensor(
                [len(x.response_ids) if x.loss_mask is None else sum(x.loss_mask) for x in flat],
                dtype=torch.float32,
            )
            penalty = soft_overlong_penalty(
                lengths, s.overlong_penalty_length, s.overlong_penalty_cache
            ).view_as(rewards)
            batch.stats["reward/overlong_penalty_mean"] = float(penalty.mean())
            rewards = rewards + penalty
        return rewards

    def _with_model_scores(
        self, rule: torch.Tensor, flat: Sequence[RolloutSample], stats: dict[str, float]
    ) -> torch.Tensor:
        """rule_weight x the rule reward + model_weight x the reward model's score of the whole
        sequence (an episode's whole trajectory); a response with no token scores 0."""
        scored = [i for i, s in enumerate(flat) if s.response_ids]
        model = torch.zeros(len(flat))
        if scored:
            values = self.reward_model.score(
                [list(flat[i].prompt_ids) for i in scored],
                [list(flat[i].response_ids) for i in scored],
            )
            model[scored] = torch.tensor(values, dtype=torch.float32)
        model = model.view_as(rule)
        stats["reward/rule_mean"] = float(rule.mean())
        stats["reward/model_mean"] = float(model.mean())
        stats["reward/model_std"] = float(model.std()) if model.numel() > 1 else 0.0
        return self.settings.rule_weight * rule + self.settings.model_weight * model

    # -- weights, state, faults ---------------------------------------------------------------

    def update_weights(self, version: int) -> None:
        self.driver.update_weights(version)

    def fault_metrics(self) -> dict[str, float]:
        return self.driver.fault_metrics()

    def set_max_staleness(self, bound: int) -> None:
        """A new rollout.max_staleness (the mismatch budget's remedy lower_staleness): the
        batches generated ahead under the old bound are abandoned and generate again."""
        if bound == self.settings.max_staleness:
            return
        self.settings = dataclasses.replace(self.settings, max_staleness=bound)
        if self.pipeline is not None:
            self.rewind(self.sampler_state())
            self.pipeline.max_staleness = bound

    def sampler_state(self) -> dict:
        """The sampler as a checkpoint records it: before any batch generated ahead."""
        if self.pipeline is not None:
            return self.pipeline.sampler_state()
        return self.sampler.state_dict()

    def rewind(self, sampler_state: dict) -> None:
        """Back to `sampler_state` (a checkpoint's, or the step's that never happened),
        forgetting the batches generated ahead."""
        if self.pipeline is not None:
            self.pipeline.abandon()
        self.sampler.load_state_dict(sampler_state)

    def in_flight(self) -> tuple[dict | None, dict | None]:
        """The batches generated ahead, for a checkpoint (rollout/inflight.py): (the summary
        every rank records, the file's content on rank 0). (None, None) when there are none.
        Collective: the engine reports its progress to rank 0."""
        if self.pipeline is None or not self.pipeline.ahead:
            return None, None
        batches = self.pipeline.in_flight()
        payload = to_payload(batches) if self.ranks.rank == 0 else None
        return self.ranks.broadcast(summary(batches) if self.ranks.rank == 0 else None), payload

    def restore_in_flight(self, record: dict | None, read_file) -> None:
        """After `rewind` to a checkpoint's sampler and the weight sync: continue the batches
        that were in flight from the checkpoint's record (`read_file(name)`: the file's content,
        called on rank 0). A record this run cannot use (another mode, other sampling settings,
        other prompts) is said in one line, and those batches are generated again."""
        if record is None:
            return
        count = len(record["steps"])
        if self.pipeline is None:
            note(
                f"the checkpoint holds {count} batches generated ahead; rollout.mode=sync "
                "generates each step's batch when it trains: their prompts are drawn again"
            )
            return
        batches, problem = None, None
        if self.ranks.rank == 0:
            try:
                batches = from_payload(read_file(record["file"]), record["file"])
            except (InFlightError, CheckpointError) as err:
                problem = str(err)
        problem = self.ranks.broadcast(problem)
        if problem is None:
            problem = self.pipeline.restore(record["steps"], batches)
        if problem is not None:
            note(f"{count} batches in flight at the checkpoint are generated again: {problem}")
            return
        note(
            f"continuing {count} batches in flight at the checkpoint: "
            f"{record['complete_samples']} of {record['samples']} samples complete, "
            f"{record['tokens']} tokens generated"
        )

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        self.driver.engine.close()


def derive_seed(seed: int, step: int, salt: int, timeline: int = 0) -> int:
    """Per-step seeds derived from the run seed (resumed runs draw the same ones); `timeline`:
    the rollbacks so far, each of which draws new ones."""
    mixed = seed * 1_000_003 + (step + 1) * 7919 + salt * 104_729 + timeline * 15_485_863
    return mixed % (2**31 - 1)


def _select(batch: RolloutBatch, index: torch.Tensor) -> RolloutBatch:
    idx = [int(i) for i in index]
    out = RolloutBatch(
        prompts=[batch.prompts[i] for i in idx],
        groups=[batch.groups[i] for i in idx],
        rewards=batch.rewards[idx] if idx else batch.rewards[:0],
    )
    out.stats = dict(batch.stats)
    return out


def _concat(a: RolloutBatch, b: RolloutBatch) -> RolloutBatch:
    out = RolloutBatch(
        prompts=a.prompts + b.prompts,
        groups=a.groups + b.groups,
        rewards=torch.cat([a.rewards, b.rewards]),
    )
    out.stats = {**a.stats, **b.stats}
    return out


def _generation_metrics(generated: Sequence[RolloutBatch]) -> dict[str, float]:
    """Rewards and lengths of everything generated this step (before any filtering); none when
    every group was dropped (the staleness bound)."""
    flat = [s for b in generated for s in b.flat()]
    if not flat:
        return {"reward/failed_fraction": 0.0, "response/tokens": 0.0}
    rewards = torch.cat([b.rewards for b in generated])
    return {
        "reward/failed_fraction": sum(b.failed_rewards for b in generated) / max(len(flat), 1),
        **rollout_metrics(
            rewards,
            torch.tensor([len(s.response_ids) for s in flat]),
            torch.tensor([s.finish_reason == "length" for s in flat]),
        ),
        **_episode_metrics(flat, rewards.flatten().tolist()),
    }


def _episode_metrics(flat: Sequence[RolloutSample], rewards: list[float]) -> dict[str, float]:
    """Turns, tool use and environment failures of multi-turn episodes (none: {})."""
    records = [s.episode for s in flat if s.episode is not None]
    if not records:
        return {}
    n = len(records)
    called = [r.tool_calls > 0 for r in records]
    out = {
        "env/turns_mean": sum(r.turns for r in records) / n,
        "env/tool_calls_per_episode": sum(r.tool_calls for r in records) / n,
        "env/tool_call_rate": sum(called) / n,
        "env/tool_errors": float(sum(r.tool_errors for r in records)),
        "env/failures": float(sum(r.failure == "error" for r in records)),
        "env/timeouts": float(sum(r.failure == "timeout" for r in records)),
        "env/malformed": float(sum(r.failure == "malformed" for r in records)),
        "env/ended_by_tool_error": float(sum(r.failure == "tool_error" for r in records)),
        "env/truncated_observations": float(sum(r.truncated_observation for r in records)),
        "env/model_token_fraction": sum(sum(s.loss_mask or ()) for s in flat)
        / max(sum(len(s.response_ids) for s in flat), 1),
    }
    # Exact solves with and without a tool call: what the tool is worth to the policy.
    for key, use in (("env/solved_with_tools", True), ("env/solved_without_tools", False)):
        picked = [r for r, c in zip(rewards, called, strict=True) if c == use]
        if picked:
            out[key] = sum(r >= 1.0 for r in picked) / len(picked)
    return out
