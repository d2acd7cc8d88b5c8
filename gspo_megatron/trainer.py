"""The RL loop (docs/ARCHITECTURE.md §3): generate -> score -> advantages -> old log-probs ->
train -> sync weights -> log, evaluate, checkpoint. Every rank runs this loop; collectives happen
inside the training and rollout engines, and rank 0 scores, logs and writes files.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gspo_megatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    correct_mismatch,
    dapo_keep_indices,
    dupo_fill_indices,
    explained_variance,
    explained_variance_from_sums,
    finalize_metrics,
    gae,
    kl_estimate,
    masked_whiten,
    overlong_filter_mask,
    prefilter_solved_prompts,
    rollout_metrics,
    soft_overlong_penalty,
    token_rewards,
)
from gspo_megatron.algorithms.losses import get_policy_loss
from gspo_megatron.config import RunConfig
from gspo_megatron.data.dataset import Prompt
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.evaluation.benchmarks import Benchmark, run_benchmark
from gspo_megatron.ranks import Ranks
from gspo_megatron.rollout.driver import RolloutDriver
from gspo_megatron.rollout.engine import (
    RolloutEngine,
    RolloutSample,
    RolloutUnavailableError,
    SamplingParams,
    WeightSource,
    response_text,
)
from gspo_megatron.rollout.episodes import EpisodeRunner, episode_rewards
from gspo_megatron.rollout.pipeline import RolloutPipeline
from gspo_megatron.run_files import note
from gspo_megatron.run_health import RunHealth
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.sample import TrainSample


@dataclass
class RolloutBatch:
    """One step's groups: G responses per prompt, with their rewards and advantages."""

    prompts: list[Prompt]
    groups: list[list[RolloutSample]]
    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [groups, G]
    failed_rewards: int = 0  # reward calls that raised or timed out
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [groups, G]
    samples: list[TrainSample] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def flat(self) -> list[RolloutSample]:
        return [s for group in self.groups for s in group]


class Trainer:
    """Owns the loop. Everything it talks to comes in as an object, so the loop runs the same
    with megatron engines and real processes (components.build_trainer) or with fakes:

    engine / reference: `train_step`, `forward`, `layout.dp`, `model_config.is_moe`,
        `current_lr()`, `close()`, and `offload` / `reload` with trainer.offload_during_rollout
        (gspo_megatron.megatron.engine.TrainingEngine).
    critic: PPO's value model with algorithm.advantage=gae (`forward` -> values,
        `train_value_step`, `close`, `offload` / `reload`); saved with the policy.
    reward_model: a learned reward model with reward.model_path (`score(prompts, responses)`,
        collective; gspo_megatron.megatron.reward_model.RewardModel).
    rollout, weight_source: a RolloutEngine and what it syncs weights from, called through a
        RolloutDriver (rank 0 alone generates with server engines, and shares the samples).
    scorer, tokenizer, train_data: rewards, text, prompts. benchmarks: what `evaluate` runs
        (evaluation/benchmarks.py: build_benchmarks).
    ranks: this rank, rank 0's objects and votes (gspo_megatron.ranks).
    log: metrics sink (run_files.MetricsLogger: write, rewind, summary, close).
    checkpoints: checkpoint store (run_files.RunCheckpoints: save, resume).
    watchdog: start/stop around the loop (peers.PeerWatchdog).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        engine,
        rollout: RolloutEngine,
        scorer,
        tokenizer,
        train_data,
        benchmarks: Sequence[Benchmark],
        ranks: Ranks,
        log,
        checkpoints,
        watchdog,
        weight_source: WeightSource | None = None,
        reference=None,
        critic=None,
        reward_model=None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.rollout = rollout
        self.rollouts = RolloutDriver(rollout, ranks, weight_source)
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.benchmarks = list(benchmarks)
        self.weight_source = weight_source
        self.reference = reference
        self.critic = critic
        self.reward_model = reward_model
        self.ranks = ranks
        self.rank = ranks.rank
        self.files = checkpoints
        self.log = log
        self.watchdog = watchdog
        self.sampler = PromptSampler(
            train_data,
            cfg.rollout.prompts_per_step,
            seed=cfg.seed + cfg.data.seed,
            shuffle=cfg.data.shuffle,
        )
        self.episodes = None
        if cfg.env.enabled:
            self.episodes = EpisodeRunner(cfg.env, tokenizer, ranks, cfg.engine.max_sequence_length)
        self.pipeline = None
        if cfg.rollout.mode != "sync":
            self.pipeline = RolloutPipeline(
                self.rollouts,
                self.sampler,
                ranks,
                depth=cfg.rollout.queue_batches if cfg.rollout.mode == "async" else 1,
                max_staleness=cfg.rollout.max_staleness,
                group_size=cfg.rollout.group_size,
                params_for=lambda step: self._sampling_params(step, 0),
            )
        self.loss = LossSettings(
            cfg.algorithm.loss,
            cfg.algorithm.loss_hparams(cfg.rollout.max_new_tokens),
            kl_coef=cfg.algorithm.kl_coef,
            kl_estimator=cfg.algorithm.kl_estimator,
            entropy_coef=cfg.algorithm.entropy_coef,
        )
        self.step = 0
        self.stop_requested = False
        self._stop_signal: str | None = None  # the signal that asked for it, not yet logged
        self.stop_token_ids = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        self.health = RunHealth(cfg)
        self._last_save = time.monotonic()
        self._replaced_handlers: dict[int, object] = {}

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        # Put back by close(), not here: a run that fails must still be holding SIGTERM while it
        # prints its error, since torchrun signals the other ranks as soon as one rank exits.
        self._replaced_handlers = self._install_signal_handlers()
        self.resume()
        self.watchdog.start()
        try:
            last = self._loop()
            self.save()
        finally:
            self.watchdog.stop()
        self.log.summary(last)
        return last

    def _loop(self) -> dict[str, float]:
        last: dict[str, float] = {}
        while self.step < self.cfg.trainer.steps and not self.stop_requested:
            started = time.perf_counter()
            cpu_started = time.process_time()
            timings: dict[str, float] = {}
            offloading = bool(self._offloaded_engines())
            moved: dict[str, float] = {}
            if offloading:
                with _timed(timings, "offload"):
                    moved.update(self.offload_for_rollout())
            sampler_at_start = self._sampler_state()
            try:
                with _timed(timings, "generate"):
                    batch = self.generate()
            except RolloutUnavailableError:
                # The step never happened: checkpoint the state before it (none is needed
                # before the first step: a new start is the same run), then stop.
                if self.pipeline is not None:
                    self.pipeline.abandon()
                self.sampler.load_state_dict(sampler_at_start)
                if self.step > 0:
                    self.save()
                raise
            if offloading:
                with _timed(timings, "reload"):
                    moved.update(self.reload_after_rollout())
                batch.stats.update({f"perf/{k}": v for k, v in moved.items()})
            with _timed(timings, "old_logprobs"):
                if batch.groups:
                    self.prepare_training_inputs(batch)
            with _timed(timings, "train"):
                train_metrics = self.train_step(batch)
            with _timed(timings, "sync_weights"):
                self.sync_weights()
            self.step += 1
            timings["step"] = time.perf_counter() - started
            timings["step_cpu"] = time.process_time() - cpu_started
            last = self.step_metrics(batch, train_metrics, timings)
            every = self.cfg.eval.every
            if (every and self.step % every == 0) or self.step == self.cfg.trainer.steps:
                try:
                    last.update(self.evaluate())
                except RolloutUnavailableError:
                    self.log.write(self.step, last)  # the step trained: keep its record
                    self.save()
                    raise
            self.log.write(self.step, last)
            verdict = self.health.check(last)
            save_now, self.stop_requested = self._agree_on_save_and_stop()
            if verdict is not None:
                if verdict.checkpoint_first:
                    self.save()
                raise verdict.error
            if save_now:
                self.save()
        return last

    # -- phases ------------------------------------------------------------------------------

    def _offloaded_engines(self) -> list[tuple[object, str, bool]]:
        """(engine, what, keep its weights) per engine that trainer.offload_during_rollout moves."""
        what = self.cfg.trainer.offload_during_rollout
        if what == "none":
            return []
        # The embedded rollout engine generates with the policy's weights.
        engines = [(self.engine, what, self.cfg.rollout.engine == "embedded")]
        if self.critic is not None:
            engines.append((self.critic, what, False))
        if what == "all" and self.reference is not None:
            engines.append((self.reference, "all", False))
        return engines

    def offload_for_rollout(self) -> dict[str, float]:
        """Training state to host memory while the rollout engine generates (after the weight
        sync: SGLang has the weights before the trainer's copy leaves)."""
        moved = [
            engine.offload(what, keep_weights=keep)
            for engine, what, keep in self._offloaded_engines()
        ]
        return {"offload_bytes": sum(m.get("offload_bytes", 0.0) for m in moved)}

    def reload_after_rollout(self) -> dict[str, float]:
        moved = [engine.reload() for engine, _, _ in self._offloaded_engines()]
        return {"reload_bytes": sum(m.get("reload_bytes", 0.0) for m in moved)}

    def generate(self) -> RolloutBatch:
        """Rollouts for one step, with rewards and advantages; dynamic sampling fills the batch."""
        alg = self.cfg.algorithm
        wanted = self.cfg.rollout.prompts_per_step
        stats: dict[str, float] = {}
        if self.pipeline is None:
            batch = self._generate_for(self.sampler.next_batch(), step_seed=0)
        else:
            prompts, groups, stats = self.pipeline.take(self.step)
            batch = self._admit(prompts, groups, stats)
        generated = [batch]
        if alg.prefilter_solved_prompts:
            keep = prefilter_solved_prompts(batch.rewards)
            stats["sampling/solved_groups_dropped"] = float((~keep).sum())
            batch = _select(batch, torch.nonzero(keep).flatten())
        if alg.dynamic_sampling == "dapo":
            kept = _select(batch, dapo_keep_indices(batch.rewards))
            rounds = 0
            while len(kept.groups) < wanted and rounds < alg.max_refill_rounds:
                rounds += 1
                more = self._generate_for(self.sampler.next_batch(), step_seed=rounds)
                generated.append(more)
                more = _select(more, dapo_keep_indices(more.rewards))
                kept = _concat(kept, more)
            stats["sampling/refill_rounds"] = float(rounds)
            batch = _select(kept, torch.arange(min(wanted, len(kept.groups))))
        elif alg.dynamic_sampling == "dupo":
            generator = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.step)
            fill = dupo_fill_indices(batch.rewards, num_groups=wanted, generator=generator)
            batch = _select(batch, fill)  # empty when no group is informative, as with DAPO
        stats.update(_generation_metrics(generated))
        if self.episodes is not None:
            stats["time/env"] = self.episodes.take_env_time()
        stats["sampling/groups_used"] = float(len(batch.groups))
        if batch.groups:
            batch.advantages = self._advantages(batch.rewards)
        batch.stats.update(stats)
        return batch

    def _sampling_params(self, step: int, step_seed: int) -> SamplingParams:
        """Sampling for the batch that trains step `step` + 1 (round `step_seed` of it)."""
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            seed=_derive_seed(self.cfg.seed, step, step_seed),
        )

    def _generate_for(self, prompts: list[Prompt], step_seed: int) -> RolloutBatch:
        params = self._sampling_params(self.step, step_seed)
        groups = self._rollout_groups(prompts, self.cfg.rollout.group_size, params)
        batch = RolloutBatch(prompts=list(prompts), groups=groups)
        batch.rewards = self.score(batch)
        return batch

    def _rollout_groups(
        self, prompts: list[Prompt], n: int, params: SamplingParams, **options
    ) -> list[list[RolloutSample]]:
        """`n` responses per prompt, or `n` episodes with an environment (env.name)."""
        if self.episodes is not None:
            return self.episodes.run(self.rollouts, prompts, n, params)
        return self.rollouts.generate([p.prompt_ids for p in prompts], n, params, **options)

    def _admit(
        self, prompts: list[Prompt], groups: list[list[RolloutSample]], stats: dict[str, float]
    ) -> RolloutBatch:
        """A batch generated ahead, checked against the staleness bound and scored.

        A group holding a token sampled more than rollout.max_staleness versions before the
        weights that train on it (`self.step`) is dropped and counted; the pipeline starts no
        batch that could produce one, so a drop means an engine broke the bound.
        """
        bound = self.cfg.rollout.max_staleness
        lags = [[self.step - v for s in group for v in s.versions()] or [0] for group in groups]
        kept = [i for i, lag in enumerate(lags) if max(lag) <= bound]
        dropped = sum(len(g) for g in groups) - sum(len(groups[i]) for i in kept)
        if dropped:
            note(
                f"step {self.step + 1}: {dropped} samples older than "
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

    def score(self, batch: RolloutBatch, *, with_model: bool = True) -> torch.Tensor:
        """Rewards [groups, G] (+ DAPO's soft overlong penalty); the rule reward scored on rank
        0, a reward model (`with_model`) on every rank."""
        flat = batch.flat()
        prompts = [p.prompt for p, g in zip(batch.prompts, batch.groups, strict=True) for _ in g]
        labels = [p.label for p, g in zip(batch.prompts, batch.groups, strict=True) for _ in g]
        texts = [self.response_text(s) for s in flat]
        payload = None
        if self.rank == 0:
            scored = self.scorer.score(prompts, texts, labels)
            payload = (scored.rewards, scored.metrics(prefix="reward/"))
        payload = self.ranks.broadcast(payload)
        rewards = torch.tensor(payload[0], dtype=torch.float32).view(len(batch.groups), -1)
        stats = dict(payload[1])
        batch.failed_rewards = int(stats["reward/failures"] + stats["reward/timeouts"])
        if self.episodes is not None:
            rewards, failed = episode_rewards(rewards, flat)
            batch.failed_rewards += failed
        if with_model and self.reward_model is not None:
            rewards = self._with_model_scores(rewards, flat, stats)
        if "reward/time_s" in stats:
            stats["time/score"] = stats.pop("reward/time_s")
        batch.stats.update(stats)
        alg = self.cfg.algorithm
        if alg.overlong_penalty_length:
            # what the policy generated: an episode's observations do not count
            lengths = torch.tensor(
                [len(s.response_ids) if s.loss_mask is None else sum(s.loss_mask) for s in flat],
                dtype=torch.float32,
            )
            penalty = soft_overlong_penalty(
                lengths, alg.overlong_penalty_length, alg.overlong_penalty_cache
            ).view_as(rewards)
            batch.stats["reward/overlong_penalty_mean"] = float(penalty.mean())
            rewards = rewards + penalty
        return rewards

    def _with_model_scores(
        self, rule: torch.Tensor, flat: Sequence[RolloutSample], stats: dict[str, float]
    ) -> torch.Tensor:
        """rule_weight x the rule reward + model_weight x the reward model's score of the whole
        sequence (an episode's whole trajectory); a response with no token scores 0."""
        r = self.cfg.reward
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
        return r.rule_weight * rule + r.model_weight * model

    def response_text(self, sample: RolloutSample) -> str:
        return response_text(sample, self.tokenizer, self.stop_token_ids)

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group advantages [groups, G]; with GAE zeros here, and each token's own advantage
        once the critic has valued the batch (prepare_training_inputs)."""
        alg = self.cfg.algorithm
        if alg.advantage == "gae":
            return torch.zeros_like(rewards)
        estimator = alg.advantage or get_policy_loss(alg.loss).advantage_estimator
        return ADVANTAGE_ESTIMATORS[estimator](rewards, eps=alg.advantage_eps)

    def prepare_training_inputs(self, batch: RolloutBatch) -> None:
        """TrainSamples with old (and reference) log-probs, routes, masks and IS weights."""
        alg = self.cfg.algorithm
        flat = batch.flat()
        masks = [None] * len(flat)
        if alg.overlong_filter:
            lengths = [len(s.response_ids) for s in flat]
            response = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
            truncated = torch.tensor([s.finish_reason == "length" for s in flat])
            kept = overlong_filter_mask(response, truncated)
            # Rows of responses that keep every token stay None (all 1).
            masks = [
                row[:n].float().tolist() if cut else None
                for row, cut, n in zip(kept, truncated.tolist(), lengths, strict=True)
            ]
        if self.episodes is not None:  # observations are context, never trained on
            masks = [_mask_product(m, s.loss_mask) for s, m in zip(flat, masks, strict=True)]
        if self.cfg.rollout.partial_rollout_mask:
            masks = [_mask_before_last_swap(s, m) for s, m in zip(flat, masks, strict=True)]
            batch.stats["async/masked_tokens"] = float(
                sum(v < max(s.versions()) for s in flat for v in s.versions())
            )
        # A response with no token (an aborted request) has no term in any loss: it is scored
        # and counted, and left out of training.
        samples = [
            TrainSample(
                prompt_ids=list(sample.prompt_ids),
                response_ids=list(sample.response_ids),
                advantage=adv,
                rollout_logprobs=list(sample.logprobs),
                loss_mask=mask,
                routed_experts=sample.routed_experts if alg.routing_replay == "r3" else None,
            )
            for sample, adv, mask in zip(
                flat, batch.advantages.flatten().tolist(), masks, strict=True
            )
            if sample.response_ids
        ]
        batch.stats["response/empty_count"] = float(len(flat) - len(samples))
        if not samples:
            batch.samples = []
            return
        moe = self.engine.model_config.is_moe
        recompute = alg.old_logprobs == "recompute"
        # Routes are recorded for R2, and for the route metrics when the forward runs anyway;
        # the metrics never add an old-policy forward of their own (with rollout log-probs they
        # come from the rollout's routes, under R3, or are not measured).
        record = moe and (
            alg.routing_replay == "r2" or (recompute and self.cfg.logging.moe_route_metrics)
        )
        if recompute or record:
            result = self.engine.forward(
                samples, record_routes=record, replay_routes=alg.routing_replay == "r3"
            )
            if recompute:
                for s, lp in zip(samples, result.logprobs, strict=True):
                    s.old_logprobs = lp.tolist()
            if result.routes is not None:
                batch.stats.update(_expert_load(result.routes, self.engine.model_config))
                if alg.routing_replay != "r3":
                    for s, routes in zip(samples, result.routes, strict=True):
                        s.routed_experts = routes
        elif moe and self.cfg.logging.moe_route_metrics and alg.routing_replay == "r3":
            routes = [s.routed_experts for s in samples]
            batch.stats.update(_expert_load(routes, self.engine.model_config))
        if not recompute:
            for s in samples:
                s.old_logprobs = list(s.rollout_logprobs)
        # The tokens with a rollout log-prob: all but an episode's observations.
        sampled = [s.loss_mask for s in flat if s.response_ids]
        batch.stats.update(_mismatch_stats(samples, sampled))
        if alg.mismatch != "none":
            self._mismatch_weights(samples, sampled, batch)
        if self.reference is not None:
            # Routed like the policy's training forward, so that the KL term compares the two
            # policies on the same experts (and is 0 while they are the same weights).
            ref = self.reference.forward(samples, replay_routes=alg.routing_replay != "off")
            for s, lp in zip(samples, ref.logprobs, strict=True):
                s.ref_logprobs = lp.tolist()
        if self.critic is not None:
            rewards = batch.rewards.flatten().tolist()
            kept = [r for s, r in zip(flat, rewards, strict=True) if s.response_ids]
            self._gae_advantages(samples, kept, batch)
        batch.samples = samples

    def _gae_advantages(
        self, samples: list[TrainSample], rewards: list[float], batch: RolloutBatch
    ) -> None:
        """PPO's advantages: the critic values every state, each sample's reward lands on its
        last trained token (minus the per-token KL penalty), and GAE runs over the trained
        tokens; the samples get token advantages, the values and the returns."""
        alg = self.cfg.algorithm
        values = self.critic.forward(samples).values
        lengths = [len(s.response_ids) for s in samples]
        old_values, _ = _pad([v.tolist() for v in values])
        mask, _ = _pad([s.loss_mask or [1.0] * n for s, n in zip(samples, lengths, strict=True)])
        kl = None
        if alg.kl_reward_coef:
            # pi_old (the policy that sampled) against the initial policy, per token
            old_lp, _ = _pad([s.old_logprobs for s in samples])
            ref_lp, _ = _pad([s.ref_logprobs for s in samples])
            kl = kl_estimate(old_lp, ref_lp, alg.kl_estimator)
            batch.stats["reward/kl_penalty_mean"] = float(
                alg.kl_reward_coef * (kl * mask).sum() / mask.sum().clamp(min=1.0)
            )
        per_token = token_rewards(
            torch.tensor(rewards, dtype=torch.float64), mask, kl, alg.kl_reward_coef
        )
        advantages, returns = gae(per_token, old_values, mask, alg.gamma, alg.lam)
        if alg.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
            s.advantage = advantages[i, :n].tolist()
            s.old_values = old_values[i, :n].tolist()
            s.returns = returns[i, :n].tolist()
        trained = mask != 0
        count = max(int(trained.sum()), 1)
        batch.stats.update(
            {
                "advantage/token_abs_mean": float(advantages.abs()[trained].sum() / count),
                "critic/values_mean": float(old_values[trained].sum() / count),
                "critic/returns_mean": float(returns[trained].sum() / count),
                "critic/explained_variance": explained_variance(old_values, returns, mask),
            }
        )

    def _mismatch_weights(
        self,
        samples: list[TrainSample],
        sampled: list[list[int] | None],
        batch: RolloutBatch,
    ) -> None:
        alg = self.cfg.algorithm
        rollout_lp, mask = _pad([s.rollout_logprobs for s in samples])
        old_lp, _ = _pad([s.old_logprobs for s in samples])
        if any(m is not None for m in sampled):
            rows = [m or [1] * len(s.response_ids) for s, m in zip(samples, sampled, strict=True)]
            mask &= _pad(rows)[0] != 0
        correction = correct_mismatch(
            rollout_lp,
            mask,
            old_logprobs=old_lp,
            mode=alg.mismatch,
            level=alg.mismatch_level,
            cap=alg.mismatch_cap,
            lower=alg.mismatch_lower,
            upper=alg.mismatch_upper,
        )
        weights = correction.is_weights
        for i, s in enumerate(samples):
            # Token level: [B, T]; sequence and geometric levels: one weight per sequence, [B].
            s.is_weights = (
                weights[i, : len(s.response_ids)].tolist()
                if weights.dim() == 2
                else float(weights[i])
            )
        for name, value in finalize_metrics(correction.metric_sums).items():
            batch.stats[f"mismatch/{name}"] = value

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """num_minibatches optimizer steps over the shuffled rollout batch.

        A batch that dynamic sampling left smaller than planned is split into as many
        minibatches as it can feed (each needs one sequence per data-parallel rank); an empty
        one trains nothing.
        """
        alg = self.cfg.algorithm
        order = list(range(len(batch.samples)))
        random.Random(_derive_seed(self.cfg.seed, self.step, 101)).shuffle(order)
        count = min(alg.num_minibatches, len(order) // self.engine.layout.dp)
        idle = {"optimizer_steps": 0.0, "skipped_steps": 0.0, "lr": self.engine.current_lr()}
        if count == 0:
            return idle
        bounds = [round(k * len(order) / count) for k in range(count + 1)]
        minibatches = [
            [batch.samples[i] for i in order[bounds[k] : bounds[k + 1]]] for k in range(count)
        ]
        critic = {}
        if self.critic is not None:
            clip = self.cfg.critic.value_clip or None
            per_step = [self.critic.train_value_step(m, clip=clip) for m in minibatches]
            for m in per_step:
                # of the values each update step starts from (the batch's old values: below)
                m["explained_variance_in_update"] = explained_variance_from_sums(m)
                for key in [k for k in m if k.startswith("ev_")]:
                    del m[key]
            critic = {f"critic/{k}": v for k, v in _merge_optimizer_steps(per_step).items()}
            if self.step < self.cfg.critic.warmup_steps:
                return idle | critic
        per_step = [
            self.engine.train_step(m, self.loss, replay_routes=alg.routing_replay != "off")
            for m in minibatches
        ]
        merged = _merge_optimizer_steps(per_step)
        # Route changes after k updates since the old-policy forward (the paper's per-update view).
        for k, m in enumerate(per_step):
            if "moe/route_change_fraction" in m:
                merged[f"moe/route_change_fraction_after_{k}_updates"] = m[
                    "moe/route_change_fraction"
                ]
        return merged | critic

    def sync_weights(self) -> None:
        self.rollouts.update_weights(self.step + 1)

    def evaluate(self) -> dict[str, float]:
        """Every benchmark of the eval section with the current weights
        (evaluation/benchmarks.py): eval/<metric> of the held-out prompts, eval/<name>/<metric>
        of a named benchmark; each problem's responses to eval/step_<N>/<name>.jsonl."""
        # Generated ahead of queued training batches, with the current weights.
        options = {} if self.pipeline is None else {"min_version": self.step, "urgent": True}

        def generate(problems, n, params):
            return self._rollout_groups(problems, n, params, **options)

        out: dict[str, float] = {}
        for bench in self.benchmarks:
            result = run_benchmark(bench, generate, self.response_text, self.ranks)
            prefix = "eval/" if bench.name == "heldout" else f"eval/{bench.name}/"
            out.update({prefix + k: v for k, v in result.metrics.items()})
            if self.cfg.eval.save_responses:
                self.log.write_records(self.step, bench.name, result.records)
        return out

    # -- metrics -----------------------------------------------------------------------------

    def step_metrics(
        self, batch: RolloutBatch, train: dict[str, float], timings: dict[str, float]
    ) -> dict[str, float]:
        train_tokens = float(sum(s.length for s in batch.samples))
        metrics: dict[str, float] = {
            "perf/rollout_tokens_per_s": batch.stats["response/tokens"]
            / max(timings["generate"], 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(timings["train"], 1e-9),
        }
        if batch.groups and self.critic is None:  # GAE's: advantage/token_abs_mean
            metrics["advantage/abs_mean"] = float(batch.advantages.abs().mean())
        metrics.update({k if "/" in k else f"actor/{k}": v for k, v in train.items()})
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics.update(batch.stats)
        metrics.update(self.rollouts.fault_metrics())
        return metrics

    # -- checkpoints and signals ---------------------------------------------------------------

    def _sampler_state(self) -> dict:
        """The sampler as a checkpoint records it: before any batch generated ahead."""
        if self.pipeline is not None:
            return self.pipeline.sampler_state()
        return self.sampler.state_dict()

    def _companions(self) -> dict[str, object]:
        """Engines checkpointed and resumed with the policy."""
        return {"critic": self.critic} if self.critic is not None else {}

    def save(self) -> None:
        state = {"step": self.step, "sampler": self._sampler_state()}
        self.files.save(self.engine, self.step, state, companions=self._companions())
        self._last_save = time.monotonic()

    def resume(self) -> None:
        state = self.files.resume(
            self.engine, self.cfg.trainer.resume, companions=self._companions()
        )
        if state is None:
            # Records of an earlier attempt that left no checkpoint are moved aside, not repeated.
            self.log.rewind(0)
            note("starting from step 0")
            # Servers start with their launch weights, not necessarily the trainer's.
            self.rollouts.update_weights(0)
            return
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.log.rewind(self.step)
        note(f"resumed at step {self.step}")
        self.rollouts.update_weights(self.step)

    def _install_signal_handlers(self) -> dict[int, object]:
        """SIGTERM and SIGINT ask for a checkpoint and a stop after this step; returns the
        handlers they replace.

        The handler may run in the middle of a write to the run's log (torchrun's SIGTERM
        reaches a failing rank while it logs its traceback), and logging is not reentrant: it
        only sets the flag and tells the terminal with one raw write; the log gets the note when
        the loop acts on it."""
        rank = self.ranks.rank

        def request_stop(signum, frame):
            self.stop_requested = True
            self._stop_signal = signal.Signals(signum).name
            if rank == 0:
                message = (
                    f"[gspo-megatron] signal {self._stop_signal}: checkpointing after this step"
                )
                os.write(2, (message + "\n").encode())

        return {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}

    def _agree_on_save_and_stop(self) -> tuple[bool, bool]:
        """(save now, stop now), the same on every rank: one all-reduce of each rank's view.

        A signal reaches some ranks before others, and only wall-clock time decides the
        timed saves, so ranks vote; any rank's yes wins.
        """
        if self._stop_signal is not None:
            logging.getLogger("gspo_megatron").info(
                "signal %s: checkpointing after this step", self._stop_signal
            )
            self._stop_signal = None
        t = self.cfg.trainer
        by_steps = t.save_every > 0 and self.step % t.save_every == 0
        by_time = (
            t.save_every_minutes > 0
            and time.monotonic() - self._last_save >= 60 * t.save_every_minutes
        )
        save, stop = self.ranks.any(
            [by_steps or by_time or self.stop_requested, self.stop_requested]
        )
        return save and not stop, stop

    def close(self) -> None:
        # The handlers hold this trainer (and so the model and its process groups): a process
        # that runs several trainings one after another must not keep them all.
        for signum, handler in self._replaced_handlers.items():
            signal.signal(signum, handler)
        self._replaced_handlers = {}
        self.log.close()
        self.scorer.close()
        for bench in self.benchmarks:
            bench.close()
        if self.episodes is not None:
            self.episodes.close()
        self.rollout.close()
        if self.reward_model is not None:
            self.reward_model.close()
        for engine in (self.engine, self.reference, self.critic):
            if engine is not None:
                engine.close()


# -- helpers ------------------------------------------------------------------------------------


class _timed:
    def __init__(self, sink: dict[str, float], key: str) -> None:
        self.sink, self.key = sink, key

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.sink[self.key] = self.sink.get(self.key, 0.0) + time.perf_counter() - self.start


def _mask_before_last_swap(sample: RolloutSample, mask: list[float] | None) -> list[float] | None:
    """`mask` with the tokens sampled before the response's last weight swap set to 0."""
    versions = sample.versions()
    if len(set(versions)) < 2:
        return mask
    last = max(versions)
    mask = mask or [1.0] * len(versions)
    return [m if v == last else 0.0 for m, v in zip(mask, versions, strict=True)]


def _mask_product(a: list[float] | None, b: list[int] | None) -> list[float] | None:
    if a is None or b is None:
        return a if b is None else [float(x) for x in b]
    return [x * y for x, y in zip(a, b, strict=True)]


def _merge_optimizer_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """One RL step's optimizer steps as one record: means (extremes of *_max / *_min), the step
    and skip counts, and the last learning rate."""
    merged = {}
    for key in per_step[0]:
        values = [m[key] for m in per_step if key in m]
        combine = max if key.endswith("_max") else min if key.endswith("_min") else np.mean
        merged[key] = float(combine(values))
    merged["optimizer_steps"] = float(len(per_step))
    merged["skipped_steps"] = float(sum(m.get("skipped", 0.0) for m in per_step))
    merged.pop("skipped", None)
    merged.pop("num_microbatches", None)
    merged["lr"] = per_step[-1]["lr"]
    return merged


def _derive_seed(seed: int, step: int, salt: int) -> int:
    """Per-step sampling seeds derived from the run seed (resumed runs draw the same ones)."""
    return (seed * 1_000_003 + (step + 1) * 7919 + salt * 104_729) % (2**31 - 1)


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
    """Rewards and lengths of everything generated this step (before any filtering)."""
    flat = [s for b in generated for s in b.flat()]
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


def _pad(rows: Sequence[Sequence[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(r) for r in rows)
    values = torch.zeros(len(rows), longest, dtype=torch.float64)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = True
    return values, mask


def _mismatch_stats(
    samples: Sequence[TrainSample], sampled: Sequence[list[int] | None]
) -> dict[str, float]:
    """Rollout-engine vs training-engine log-probs of the same tokens (old policy), over the
    tokens the engine sampled (`sampled`: None for all; an episode's observations have no
    rollout log-prob)."""
    diffs = [
        np.abs(np.asarray(s.rollout_logprobs) - np.asarray(s.old_logprobs))[
            slice(None) if m is None else np.asarray(m) != 0
        ]
        for s, m in zip(samples, sampled, strict=True)
        if s.old_logprobs is not None and s.rollout_logprobs is not None
    ]
    flat = np.concatenate(diffs) if diffs else np.zeros(0)
    if not flat.size:
        return {}
    return {
        "mismatch/logprob_abs_diff_mean": float(flat.mean()),
        "mismatch/logprob_abs_diff_max": float(flat.max()),
    }


def _expert_load(routes: Sequence[np.ndarray], model) -> dict[str, float]:
    """Load imbalance: per layer, the busiest expert's share over the mean share (1 = balanced)."""
    stacked = np.concatenate([r.reshape(r.shape[0], r.shape[1], -1) for r in routes], axis=0)
    worst = 0.0
    for layer in range(stacked.shape[1]):
        counts = np.bincount(stacked[:, layer].reshape(-1), minlength=model.num_experts)
        worst = max(worst, float(counts.max() / max(counts.mean(), 1e-9)))
    return {"moe/max_expert_load_over_mean": worst}
