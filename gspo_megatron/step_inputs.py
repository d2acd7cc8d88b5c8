"""What one RL step trains on (docs/ARCHITECTURE.md §3, steps 3-4), from a scored batch:

  * group advantages (the loss's estimator, or algorithm.advantage); with algorithm.credit=turn
    per-turn advantages of multi-turn episodes (algorithms/advantages.py): each model turn's
    tokens get their turn's advantage;
  * `TrainSample`s with their loss masks: DAPO's overlong filter, an episode's observations,
    the tokens before a partial rollout's last weight swap; a response with no token is left out;
  * old log-probs (the policy's forward, or the rollout's), the routes the forward recorded (R2)
    and the expert-load metrics, the reference's log-probs for the KL term;
  * the train/rollout mismatch metrics (k3 KL, tokens past a threshold, route flips per layer
    between the rollout engine's experts and the trainer's) and TIS / MIS weights
    (algorithms/mismatch.py);
  * each token's version lag (the clip fraction is split by it);
  * with algorithm.advantage=gae, PPO's token advantages: the critic values the batch and GAE
    runs over the trained tokens (algorithms/gae.py); with credit=turn each turn's reward lands
    on its last trained token.

An episode's turns (`_episode_turns`): the runs of its loss mask (observations are 0), split
where the episode runner recorded a turn start. Its turn rewards: the environment's reward for
each turn but the last, times the rule reward's weight when a reward model scores too; the last
turn carries the rest of the episode's reward (the final answer's score, the reward model's,
penalties; after a failure the whole of it), so the turn rewards sum to the episode's.

It takes its settings explicitly (`StepInputSettings`) and the engines as objects (`forward`:
gspo_megatron.megatron.training_engine.TrainingEngine, or the tests' fakes).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gspo_megatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    correct_mismatch,
    explained_variance,
    finalize_metrics,
    gae,
    kl_estimate,
    masked_whiten,
    overlong_filter_mask,
    rollout_mismatch_sums,
    token_rewards,
    turn_advantages,
    turn_end_rewards,
    turn_token_advantages,
)
from gspo_megatron.algorithms.losses import get_policy_loss
from gspo_megatron.metrics_schedule import EVERY_STEP, CostlyMetrics
from gspo_megatron.rollout.base import RolloutSample
from gspo_megatron.spec.sample import TrainSample

if TYPE_CHECKING:
    from gspo_megatron.collector import RolloutBatch
    from gspo_megatron.config import RunConfig


@dataclass(frozen=True)
class StepInputSettings:
    """What the step's inputs depend on (`from_config`: the algorithm section and two keys)."""

    advantage: str  # group_mean_std | group_mean | gae: the estimator, resolved
    advantage_eps: float
    overlong_filter: bool
    partial_rollout_mask: bool
    old_logprobs: str  # recompute | rollout
    routing_replay: str  # off | r2 | r3
    moe_route_metrics: bool
    mismatch: str  # none | tis | mis
    mismatch_level: str
    mismatch_cap: float
    mismatch_lower: float
    mismatch_upper: float
    gamma: float
    lam: float
    whiten_advantages: bool
    kl_reward_coef: float
    kl_estimator: str
    mismatch_token_threshold: float
    credit: str = "episode"  # episode | turn
    turn_gamma: float = 1.0
    step_reward_scale: float = 1.0  # the rule reward's weight when a reward model scores too
    entropy_metric: bool = True  # engine.entropy_metric: actor/entropy from the old forward

    @classmethod
    def from_config(cls, cfg: RunConfig) -> StepInputSettings:
        alg = cfg.algorithm
        return cls(
            advantage=alg.advantage or get_policy_loss(alg.loss).advantage_estimator,
            advantage_eps=alg.advantage_eps,
            overlong_filter=alg.overlong_filter,
            partial_rollout_mask=cfg.rollout.partial_rollout_mask,
            old_logprobs=alg.old_logprobs,
            routing_replay=alg.routing_replay,
            moe_route_metrics=cfg.logging.moe_route_metrics,
            mismatch=alg.mismatch,
            mismatch_level=alg.mismatch_level,
            mismatch_cap=alg.mismatch_cap,
            mismatch_lower=alg.mismatch_lower,
            mismatch_upper=alg.mismatch_upper,
            gamma=alg.gamma,
            lam=alg.lam,
            whiten_advantages=alg.whiten_advantages,
            kl_reward_coef=alg.kl_reward_coef,
            kl_estimator=alg.kl_estimator,
            mismatch_token_threshold=cfg.stability.mismatch_token_threshold,
            credit=alg.credit,
            turn_gamma=alg.turn_gamma,
            step_reward_scale=cfg.reward.rule_weight if cfg.reward.model_path else 1.0,
            entropy_metric=cfg.engine.entropy_metric,
        )


class StepInputs:
    """Builds a batch's training inputs with the policy (old log-probs, routes), the frozen
    reference (KL) and PPO's critic (values), each optional but the policy."""

    def __init__(self, settings: StepInputSettings, policy, *, reference=None, critic=None):
        self.settings = settings
        self.policy = policy
        self.reference = reference
        self.critic = critic

    def use_mismatch(self, mode: str) -> None:
        """Switch the train/rollout correction (the mismatch budget's remedy mis turns MIS on);
        config.py checked that the loss takes it at algorithm.mismatch_level."""
        self.settings = dataclasses.replace(self.settings, mismatch=mode)

    def add_advantages(self, batch: RolloutBatch) -> None:
        """Group advantages [groups, G]; with GAE zeros here, and each token's own advantage
        once the critic has valued the batch (`add_samples`); with per-turn credit each
        episode's first turn's (at turn_gamma 1 the episode's), the tokens' in `add_samples`."""
        s = self.settings
        if s.advantage == "gae":
            batch.advantages = torch.zeros_like(batch.rewards)
            return
        if s.credit == "turn":
            first = self._turn_credit(batch)[0]
            batch.advantages = first.to(batch.rewards.dtype).view_as(batch.rewards)
            return
        batch.advantages = ADVANTAGE_ESTIMATORS[s.advantage](batch.rewards, eps=s.advantage_eps)

    def add_samples(self, batch: RolloutBatch, metrics: CostlyMetrics = EVERY_STEP) -> None:
        """TrainSamples with old (and reference) log-probs, routes, masks and IS weights;
        `metrics`: which costly metrics this step computes (metrics_schedule.py)."""
        s = self.settings
        flat = batch.flat()
        masks = self._masks(flat, batch)
        # A response with no token (an aborted request) has no term in any loss: it is scored
        # and counted, and left out of training.
        samples = [
            TrainSample(
                prompt_ids=list(sample.prompt_ids),
                response_ids=list(sample.response_ids),
                advantage=adv,
                rollout_logprobs=list(sample.logprobs),
                loss_mask=mask,
                routed_experts=sample.routed_experts if s.routing_replay == "r3" else None,
                version_lags=[batch.train_version - v for v in sample.versions()],
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
        self._old_logprobs(
            samples,
            [x.routed_experts for x in flat if x.response_ids],
            batch,
            metrics.routes,
            entropy=metrics.entropy and s.entropy_metric,
        )
        # The tokens with a rollout log-prob: all but an episode's observations.
        sampled = [x.loss_mask for x in flat if x.response_ids]
        if s.old_logprobs == "recompute" and metrics.mismatch:
            batch.stats.update(_mismatch_stats(samples, sampled, s.mismatch_token_threshold))
        if s.mismatch != "none":
            self._mismatch_weights(samples, sampled, batch)
        if self.reference is not None:
            # Routed like the policy's training forward, so that the KL term compares the two
            # policies on the same experts (and is 0 while they are the same weights).
            ref = self.reference.forward(samples, replay_routes=s.routing_replay != "off")
            for x, lp in zip(samples, ref.logprobs, strict=True):
                x.ref_logprobs = lp.tolist()
        if self.critic is not None:
            self._gae_advantages(samples, batch)
        elif s.credit == "turn":
            # After the forwards: they take no token advantages (the loss's micro-batches do).
            kept = [
                adv
                for x, adv in zip(flat, self._turn_credit(batch)[1], strict=True)
                if x.response_ids
            ]
            for x, adv in zip(samples, kept, strict=True):
                x.advantage = adv
        batch.samples = samples

    def _masks(self, flat: list[RolloutSample], batch: RolloutBatch) -> list[list[float] | None]:
        """Each response's loss mask (None: every token trains)."""
        masks: list[list[float] | None] = [None] * len(flat)
        if self.settings.overlong_filter:
            lengths = [len(x.response_ids) for x in flat]
            response = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
            truncated = torch.tensor([x.finish_reason == "length" for x in flat])
            kept = overlong_filter_mask(response, truncated)
            # Rows of responses that keep every token stay None (all 1).
            masks = [
                row[:n].float().tolist() if cut else None
                for row, cut, n in zip(kept, truncated.tolist(), lengths, strict=True)
            ]
        # An episode's observations are context, never trained on.
        masks = [_mask_product(m, x.loss_mask) for x, m in zip(flat, masks, strict=True)]
        if self.settings.partial_rollout_mask:
            masks = [_mask_before_last_swap(x, m) for x, m in zip(flat, masks, strict=True)]
            batch.stats["async/masked_tokens"] = float(
                sum(v < max(x.versions()) for x in flat for v in x.versions())
            )
        return masks

    def _old_logprobs(
        self,
        samples: list[TrainSample],
        rollout_routes: list[np.ndarray | None],
        batch: RolloutBatch,
        route_metrics: bool = True,
        entropy: bool = False,
    ) -> None:
        """π_old (recomputed, or the rollout's), the routes, and with `route_metrics` the
        expert-load metrics and the route flips between the rollout engine's experts and the
        old-policy forward's. With `entropy` and a recompute, actor/entropy: π_old's mean entropy
        over the trained tokens, from the same forward (one pass over the vocabulary a step,
        where the training forwards would take one per optimizer step)."""
        s = self.settings
        model = self.policy.model_config
        recompute = s.old_logprobs == "recompute"
        # Routes are recorded for R2, and for the route metrics when the forward runs anyway;
        # the metrics never add an old-policy forward of their own (with rollout log-probs they
        # come from the rollout's routes, under R3, or are not measured).
        record = model.is_moe and (
            s.routing_replay == "r2" or (recompute and s.moe_route_metrics and route_metrics)
        )
        if recompute or record:
            result = self.policy.forward(
                samples,
                with_entropy=entropy and recompute,
                record_routes=record,
                replay_routes=s.routing_replay == "r3",
            )
            if recompute:
                for x, lp in zip(samples, result.logprobs, strict=True):
                    x.old_logprobs = lp.tolist()
            if result.entropy is not None:
                mean = _trained_token_mean(samples, result.entropy)
                if mean is not None:
                    batch.stats["actor/entropy"] = mean
            if result.routes is not None and route_metrics:
                batch.stats.update(_expert_load(result.routes, model.num_experts))
                batch.stats.update(_route_flips(rollout_routes, result.routes))
            if result.routes is not None and s.routing_replay != "r3":
                for x, routes in zip(samples, result.routes, strict=True):
                    x.routed_experts = routes
        elif model.is_moe and s.moe_route_metrics and route_metrics and s.routing_replay == "r3":
            routes = [x.routed_experts for x in samples]
            batch.stats.update(_expert_load(routes, model.num_experts))
        if not recompute:
            for x in samples:
                x.old_logprobs = list(x.rollout_logprobs)

    def _turn_credit(self, batch: RolloutBatch) -> tuple[torch.Tensor, list[list[float]]]:
        """Per-turn credit: each episode's first-turn advantage [N] (0 for an empty response)
        and each response's token advantages (0 on observations)."""
        s = self.settings
        flat = batch.flat()
        turns, rewards = self._turns(batch)
        if not any(rewards):  # no response has a token
            return torch.zeros(len(flat), dtype=torch.float64), [[] for _ in flat]
        token_turns = _pad_ids(turns)
        turn_rewards, turn_mask = _pad(rewards)
        group_ids = torch.tensor([i for i, group in enumerate(batch.groups) for _ in group])
        advantages = turn_advantages(
            turn_rewards, turn_mask, group_ids, s.turn_gamma,
            normalize_std=s.advantage == "group_mean_std", eps=s.advantage_eps,
        )  # fmt: skip
        tokens = turn_token_advantages(advantages, token_turns)
        per_token = [tokens[i, : len(x.response_ids)].tolist() for i, x in enumerate(flat)]
        return advantages[:, 0], per_token

    def _turns(self, batch: RolloutBatch) -> tuple[list[list[int]], list[list[float]]]:
        """Every response's token turns and turn rewards (`_episode_turns`)."""
        totals = batch.rewards.flatten().tolist()
        pairs = [
            _episode_turns(x, total, self.settings.step_reward_scale)
            for x, total in zip(batch.flat(), totals, strict=True)
        ]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _gae_advantages(self, samples: list[TrainSample], batch: RolloutBatch) -> None:
        """PPO's advantages: the critic values every state, each sample's reward lands on its
        last trained token (with per-turn credit: each turn's reward on the turn's last trained
        token; minus the per-token KL penalty), and GAE runs over the trained tokens; the
        samples get token advantages, the values and the returns."""
        s = self.settings
        kept = [i for i, x in enumerate(batch.flat()) if x.response_ids]
        totals = batch.rewards.flatten().tolist()
        rewards = [totals[i] for i in kept]
        values = self.critic.forward(samples).values
        lengths = [len(x.response_ids) for x in samples]
        old_values, _ = _pad([v.tolist() for v in values])
        mask, _ = _pad([x.loss_mask or [1.0] * n for x, n in zip(samples, lengths, strict=True)])
        kl = None
        if s.kl_reward_coef:
            # pi_old (the policy that sampled) against the initial policy, per token
            old_lp, _ = _pad([x.old_logprobs for x in samples])
            ref_lp, _ = _pad([x.ref_logprobs for x in samples])
            kl = kl_estimate(old_lp, ref_lp, s.kl_estimator)
            batch.stats["reward/kl_penalty_mean"] = float(
                s.kl_reward_coef * (kl * mask).sum() / mask.sum().clamp(min=1.0)
            )
        if s.credit == "turn":
            turns, turn_rewards = self._turns(batch)
            token_turns = _pad_ids([turns[i] for i in kept], mask.shape[1])
            per_token = token_rewards(torch.zeros(len(kept)), mask, kl, s.kl_reward_coef)
            per_token += turn_end_rewards(
                _pad([turn_rewards[i] for i in kept])[0], token_turns, mask
            )
        else:
            per_token = token_rewards(
                torch.tensor(rewards, dtype=torch.float64), mask, kl, s.kl_reward_coef
            )
        advantages, returns = gae(per_token, old_values, mask, s.gamma, s.lam)
        if s.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        for i, (x, n) in enumerate(zip(samples, lengths, strict=True)):
            x.advantage = advantages[i, :n].tolist()
            x.old_values = old_values[i, :n].tolist()
            x.returns = returns[i, :n].tolist()
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
        self, samples: list[TrainSample], sampled: list[list[int] | None], batch: RolloutBatch
    ) -> None:
        s = self.settings
        rollout_lp, mask = _pad([x.rollout_logprobs for x in samples])
        old_lp, _ = _pad([x.old_logprobs for x in samples])
        if any(m is not None for m in sampled):
            rows = [m or [1] * len(x.response_ids) for x, m in zip(samples, sampled, strict=True)]
            mask &= _pad(rows)[0] != 0
        correction = correct_mismatch(
            rollout_lp,
            mask,
            old_logprobs=old_lp,
            mode=s.mismatch,
            level=s.mismatch_level,
            cap=s.mismatch_cap,
            lower=s.mismatch_lower,
            upper=s.mismatch_upper,
        )
        weights = correction.is_weights
        for i, x in enumerate(samples):
            # Token level: [B, T]; sequence and geometric levels: one weight per sequence, [B].
            x.is_weights = (
                weights[i, : len(x.response_ids)].tolist()
                if weights.dim() == 2
                else float(weights[i])
            )
        for name, value in finalize_metrics(correction.metric_sums).items():
            batch.stats[f"mismatch/{name}"] = value


def _episode_turns(
    sample: RolloutSample, total: float, step_scale: float
) -> tuple[list[int], list[float]]:
    """(turn index of each response token, -1 on observations; each turn's reward) of one
    response (the module docstring). A response with no token has no turn."""
    n = len(sample.response_ids)
    mask = sample.loss_mask or [1] * n
    record = sample.episode
    recorded = record.turn_rewards if record is not None else []
    starts = {i for i in range(n) if mask[i] and (i == 0 or not mask[i - 1])}
    if record is not None:
        starts.update(i for i in (*(t for t, _ in recorded), record.answer_start) if i < n)
    token_turns, turn = [], -1
    for i in range(n):
        if mask[i] and i in starts:
            turn += 1
        token_turns.append(turn if mask[i] else -1)
    rewards = [0.0] * (turn + 1)
    if not rewards:
        return token_turns, rewards
    for start, reward in recorded:
        # a turn's own reward; the last turn's comes with the rest of the episode's
        if start < n and mask[start] and token_turns[start] < turn:
            rewards[token_turns[start]] += step_scale * reward
    rewards[-1] = total - sum(rewards[:-1])
    return token_turns, rewards


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


def _pad_ids(rows: Sequence[Sequence[int]], width: int | None = None) -> torch.Tensor:
    """Token turns [B, width] (default: the longest row), -1 past each row."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _trained_token_mean(
    samples: Sequence[TrainSample], values: Sequence[np.ndarray]
) -> float | None:
    """The mean of per-token `values` over the tokens the loss trains (each sample's loss mask,
    1 where none is given), in float64; None when it trains none."""
    total = count = 0.0
    for sample, row in zip(samples, values, strict=True):
        row = np.asarray(row, dtype=np.float64)
        if sample.loss_mask is None:
            total, count = total + row.sum(), count + len(row)
        else:
            mask = np.asarray(sample.loss_mask, dtype=np.float64)
            total, count = total + (row * mask).sum(), count + mask.sum()
    return float(total / count) if count else None


def _pad(rows: Sequence[Sequence[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, longest] float64 right-padded rows and their mask, filled in one assignment."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    mask = np.arange(int(lengths.max()))[None, :] < lengths[:, None]
    values = np.zeros(mask.shape, dtype=np.float64)
    values[mask] = np.fromiter(
        itertools.chain.from_iterable(rows), dtype=np.float64, count=int(lengths.sum())
    )
    return torch.from_numpy(values), torch.from_numpy(mask)


def _mismatch_stats(
    samples: Sequence[TrainSample], sampled: Sequence[list[int] | None], threshold: float
) -> dict[str, float]:
    """Rollout-engine vs training-engine log-probs of the same tokens (old policy), over the
    tokens the engine sampled (`sampled`: None for all; an episode's observations have no
    rollout log-prob): k3 KL, tokens past `threshold`, absolute differences."""
    rollout_lp, mask = _pad([s.rollout_logprobs for s in samples])
    trainer_lp, _ = _pad([s.old_logprobs for s in samples])
    if any(m is not None for m in sampled):
        rows = [m or [1] * len(s.response_ids) for s, m in zip(samples, sampled, strict=True)]
        mask &= _pad(rows)[0] != 0
    if not mask.any():
        return {}
    sums = rollout_mismatch_sums(rollout_lp, trainer_lp, mask, threshold)
    return {f"mismatch/{k}": v for k, v in finalize_metrics(sums).items()}


def _route_flips(
    rollout_routes: Sequence[np.ndarray | None], trainer_routes: Sequence[np.ndarray]
) -> dict[str, float]:
    """moe/route_flips (all layers) and moe/route_flips/layer_<L>: the fraction of consumed
    tokens whose experts in layer L differ between the rollout engine and the trainer's
    old-policy forward (what its routers used: under R3, the replayed experts). Nothing when the
    rollout engine reported no routes."""
    if not rollout_routes or any(r is None for r in rollout_routes):
        return {}
    layers = trainer_routes[0].shape[1]
    if [len(a) for a in rollout_routes] == [len(b) for b in trainer_routes] and all(
        np.ndim(a) == 3 for a in rollout_routes
    ):  # the same tokens, already [tokens, layers, top_k]: nothing to cut or reshape
        given, used = rollout_routes, trainer_routes
    else:
        given, used = [], []
        for a, b in zip(rollout_routes, trainer_routes, strict=True):
            n = min(len(a), len(b))
            given.append(np.asarray(a[:n]).reshape(n, layers, -1))
            used.append(np.asarray(b[:n]).reshape(n, layers, -1))
    # every consumed token of the batch at once: the experts as sets (sorted), compared
    given_sets = _ascending(np.concatenate(given))
    used_sets = _ascending(np.concatenate(used).astype(given_sets.dtype))
    changed = (given_sets != used_sets).any(-1).sum(0).astype(np.float64)
    tokens = len(given_sets)
    sums = {"route_flips/sum": changed.sum(), "route_flips/count": float(tokens * layers)}
    for layer in range(layers):
        sums[f"route_flips/layer_{layer}/sum"] = changed[layer]
        sums[f"route_flips/layer_{layer}/count"] = float(tokens)
    return {f"moe/{k}": v for k, v in finalize_metrics(sums).items()}


def _ascending(experts: np.ndarray) -> np.ndarray:
    """Each token's experts (the last axis) in ascending order: np.sort, or for pairs their
    minimum and maximum (the same array; numpy sorts many pairs ~10x slower)."""
    if experts.shape[-1] != 2:
        return np.sort(experts, axis=-1)
    first, second = experts[..., 0], experts[..., 1]
    return np.stack([np.minimum(first, second), np.maximum(first, second)], axis=-1)


def _expert_load(routes: Sequence[np.ndarray], num_experts: int) -> dict[str, float]:
    """Load imbalance: per layer, the busiest expert's share over the mean share (1 = balanced)."""
    stacked = np.concatenate(
        routes
        if all(r.ndim == 3 for r in routes)
        else [r.reshape(r.shape[0], r.shape[1], -1) for r in routes]
    )
    worst = 0.0
    for layer in range(stacked.shape[1]):
        counts = np.bincount(stacked[:, layer].reshape(-1), minlength=num_experts)
        worst = max(worst, float(counts.max() / max(counts.mean(), 1e-9)))
    return {"moe/max_expert_load_over_mean": worst}
