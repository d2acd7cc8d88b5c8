"""The RL loop's option matrix through `Trainer.train()` (the code gspo-train runs), with fake
engines (tests/trainer/fakes.py): every policy loss x train/rollout mismatch correction, and
old log-probs x routing replay x KL x dynamic sampling, each composed and resolved like
gspo-train's config and checked against independent plain-Python references.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from trainer.fakes import SMALL, FakeRun, MemoryCheckpoints, build_fake_run

from gspo_megatron.algorithms.losses import POLICY_LOSSES
from gspo_megatron.algorithms.mismatch import mismatch_support
from gspo_megatron.config import ConfigError, resolve
from gspo_megatron.rewards.synthetic import partial_credit

# How each loss aggregates its terms (written out here, not read from the registry).
AGGREGATION = {
    "gspo": "sequence",
    "gmpo": "sequence",
    "gspo_token": "seq_mean",
    "grpo": "seq_mean",
    "sapo": "seq_mean",
    "dr_grpo": "seq_constant",
    "ppo": "token",
    "dapo": "token",
    "cispo": "token",
}
SEQUENCE_RATIO_LOSSES = {"gspo", "gmpo"}
MODES = ("none", "tis", "mis")
LEVELS = ("token", "sequence", "geometric")
MISMATCH_NOISE = 1.0  # std of the rollout's log-prob noise: corrections on both sides of 1
TOL = 1e-10


pytestmark = pytest.mark.usefixtures("one_thread")


def run_fake(composer, tokenizer, *overrides: str, noise: float = 0.05, **kwargs) -> FakeRun:
    cfg, model, layout = composer.resolve(*overrides)
    run = build_fake_run(cfg, model, layout, tokenizer, logprob_noise=noise, **kwargs)
    run.train()
    return run


# -- independent references (plain Python, float64) ------------------------------------------


class ReferenceModel:
    """The fake policy's log-probs, recomputed in plain Python from a snapshot of its weights."""

    def __init__(self, policy, params) -> None:
        self.table = params["table"].tolist()
        self.experts = params["experts"].tolist() if "experts" in params else None
        self.router = None if policy.router is None else policy.router.tolist()
        self.top_k = policy.model_config.num_experts_per_tok
        self._rows: dict[tuple, list[float]] = {}

    def own_routes(self, token: int) -> tuple:
        """Each layer's top-k experts of the router's scores for `token`, in ascending id."""
        return tuple(
            tuple(sorted(sorted(range(len(s)), key=lambda e: -s[e])[: self.top_k]))
            for s in self.router[token]
        )

    def _log_softmax_after(self, token: int, routes: tuple) -> list[float]:
        key = (token, routes)
        if key not in self._rows:
            row = list(self.table[token])
            for layer, chosen in enumerate(routes):
                for e in chosen:
                    row = [a + b for a, b in zip(row, self.experts[layer][e], strict=True)]
            top = max(row)
            lse = top + math.log(sum(math.exp(x - top) for x in row))
            self._rows[key] = [x - lse for x in row]
        return self._rows[key]

    def logprobs(self, sample, replay: bool) -> list[float]:
        """log pi(response token | previous token), routing with the sample's routes when
        replaying, else with the policy's own router."""
        ids = sample.prompt_ids + sample.response_ids
        rows = self.log_softmax_rows(sample, replay)
        return [row[ids[len(sample.prompt_ids) + t]] for t, row in enumerate(rows)]

    def entropies(self, sample, replay: bool) -> list[float]:
        return [-sum(math.exp(x) * x for x in row) for row in self.log_softmax_rows(sample, replay)]

    def log_softmax_rows(self, sample, replay: bool) -> list[list[float]]:
        """log pi(. | previous token) at each response position."""
        ids = sample.prompt_ids + sample.response_ids
        out = []
        for t in range(len(sample.response_ids)):
            j = len(sample.prompt_ids) - 1 + t
            routes = ()
            if self.experts is not None:
                routes = (
                    tuple(map(tuple, sample.routed_experts[j].tolist()))
                    if replay
                    else self.own_routes(ids[j])
                )
            out.append(self._log_softmax_after(ids[j], routes))
        return out


def _clamp(x: float, bound: float = 20.0) -> float:
    return max(-bound, min(bound, x))


def _ppo(ratio: float, adv: float, lo: float, hi: float, c: float | None = None) -> float:
    """min(r·A, clip(r, 1-lo, 1+hi)·A), dual-clipped at c·A for A < 0."""
    objective = min(ratio * adv, min(max(ratio, 1.0 - lo), 1.0 + hi) * adv)
    if c is not None and adv < 0:
        objective = max(objective, c * adv)
    return objective


def _k3(log_r: float) -> float:
    return math.exp(log_r) - 1.0 - log_r


def reference_loss(policy, call) -> float:
    """The weighted policy loss (+ KL - entropy bonus) of one train_step call, sequence by
    sequence."""
    model = ReferenceModel(policy, call.params_before)
    name, kl_coef, entropy_coef = call.loss.name, call.loss.kl_coef, call.loss.entropy_coef
    assert call.loss.kl_estimator == "k3"
    hp = dict(POLICY_LOSSES[name].defaults)
    hp.update({k: v for k, v in call.loss.hparams.items() if v is not None})
    lo, hi = hp.get("clip_low"), hp.get("clip_high")
    agg = AGGREGATION[name]
    total = kl_total = entropy_total = 0.0
    sequences = tokens = 0
    for s in call.samples:
        lp = model.logprobs(s, call.replay_routes)
        n = len(s.response_ids)
        mask = s.loss_mask if s.loss_mask is not None else [1.0] * n
        length = sum(mask)
        if length == 0:
            continue
        sequences += 1
        tokens += length
        adv = s.advantage if isinstance(s.advantage, list) else [s.advantage] * n
        weight = s.is_weights
        weights = weight if isinstance(weight, list) else [1.0 if weight is None else weight] * n
        log_r = [lp[t] - s.old_logprobs[t] for t in range(n)]
        seq_ratio = math.exp(_clamp(sum(m * x for m, x in zip(mask, log_r, strict=True)) / length))
        if name == "gspo":
            total += -_ppo(seq_ratio, s.advantage, lo, hi) * weights[0]
        elif name == "gmpo":
            a = s.advantage
            clipped = [min(x, hi) if a > 0 else max(x, -lo) if a < 0 else x for x in log_r]
            mean = sum(m * x for m, x in zip(mask, clipped, strict=True)) / length
            total += -a * math.exp(_clamp(mean)) * weights[0]
        else:
            terms = []
            for t in range(n):
                r = math.exp(_clamp(log_r[t]))
                if name == "gspo_token":
                    value = -_ppo(seq_ratio, adv[t], lo, hi)
                elif name in ("ppo", "grpo", "dapo", "dr_grpo"):
                    value = -_ppo(r, adv[t], lo, hi, hp.get("clip_c"))
                elif name == "sapo":
                    tau = hp["tau_pos"] if adv[t] > 0 else hp["tau_neg"]
                    value = -(4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0))) * adv[t]
                elif name == "cispo":
                    value = -min(r, 1.0 + hi) * adv[t] * lp[t]
                else:
                    raise AssertionError(f"no reference for loss {name}")
                terms.append(mask[t] * value * weights[t])
            total += _aggregate(agg, terms, length, hp)
        token_agg = "seq_mean" if agg == "sequence" else agg
        if kl_coef:
            kl = [mask[t] * _k3(s.ref_logprobs[t] - lp[t]) for t in range(n)]
            kl_total += _aggregate(token_agg, kl, length, hp)
        if entropy_coef:
            entropies = model.entropies(s, call.replay_routes)
            entropy = [m * h for m, h in zip(mask, entropies, strict=True)]
            entropy_total += _aggregate(token_agg, entropy, length, hp)
    denominator = tokens if agg == "token" else sequences
    if denominator == 0:  # every response filtered out (overlong filtering): loss 0
        return 0.0
    return (total + kl_coef * kl_total - entropy_coef * entropy_total) / denominator


def _aggregate(agg: str, terms: list[float], length: float, hp: dict) -> float:
    if agg == "seq_mean":
        return sum(terms) / length
    if agg == "seq_constant":
        return sum(terms) / hp["max_response_length"]
    return sum(terms)


def raw_is_weights(sample, level: str) -> list[float]:
    """pi_old / pi_rollout per token, or one ratio per sequence (in a list of one)."""
    log_w = [o - r for o, r in zip(sample.old_logprobs, sample.rollout_logprobs, strict=True)]
    if level == "token":
        return [math.exp(x) for x in log_w]
    total = sum(log_w)
    if level == "geometric":
        total /= len(log_w)
    return [math.exp(total)]


def expected_is_weights(sample, alg) -> float | list[float]:
    def correct(w: float) -> float:
        if alg.mismatch == "tis":
            return min(w, alg.mismatch_cap)
        return w if alg.mismatch_lower <= w <= alg.mismatch_upper else 0.0

    weights = [correct(w) for w in raw_is_weights(sample, alg.mismatch_level)]
    return weights if alg.mismatch_level == "token" else weights[0]


def _key(sample) -> tuple:
    return tuple(sample.prompt_ids), tuple(sample.response_ids)


def group_rewards(run: FakeRun, group) -> list[float]:
    labels = {tuple(p.prompt_ids): p.label for p in run.train_data.prompts}
    return [partial_credit(_text(run, s), str(labels[tuple(s.prompt_ids)])) for s in group]


def expected_advantages(rewards: list[float], normalize_std: bool, eps: float) -> list[float]:
    mean = sum(rewards) / len(rewards)
    if not normalize_std:
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def _step_calls(events, kind: str, engine: str | None = None) -> list:
    return [c for k, c in events if k == kind and (engine is None or c.engine == engine)]


def expected_gae(rewards, values, masks, gamma, lam) -> tuple[list, list]:
    """Per sample: GAE over its trained tokens (the reward at the last one), returns."""
    advantages, returns = [], []
    for reward, v, m in zip(rewards, values, masks, strict=True):
        steps = [t for t, keep in enumerate(m) if keep]
        adv, ret = [0.0] * len(m), [0.0] * len(m)
        following, next_value = 0.0, 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            r = reward if k == len(steps) - 1 else 0.0
            following = r + gamma * next_value - v[t] + gamma * lam * following
            adv[t], ret[t], next_value = following, following + v[t], v[t]
        advantages.append(adv)
        returns.append(ret)
    return advantages, returns


def generated_rewards(run: FakeRun, events) -> dict[tuple, float]:
    """The step's rewards, by sample (prompt and response ids)."""
    rewards = {}
    for call in _step_calls(events, "generate"):
        for group in call.groups:
            rewards.update(zip(map(_key, group), group_rewards(run, group), strict=True))
    return rewards


def check_gae_advantages(run: FakeRun, events) -> None:
    """The critic's values of the step's batch -> GAE -> (whitened over the batch's tokens)."""
    alg = run.cfg.algorithm
    (forward,) = _step_calls(events, "forward", "critic")
    rewards = generated_rewards(run, events)
    samples = forward.samples
    masks = [s.loss_mask or [1.0] * len(s.response_ids) for s in samples]
    values = [v.tolist() for v in forward.result.values]
    # the trainer holds rewards in float32
    step_rewards = [float(np.float32(rewards[_key(s)])) for s in samples]
    adv, ret = expected_gae(step_rewards, values, masks, alg.gamma, alg.lam)
    trained = [
        a for row, m in zip(adv, masks, strict=True) for a, k in zip(row, m, strict=True) if k
    ]
    mean, std = 0.0, 1.0
    if alg.whiten_advantages:
        mean = sum(trained) / len(trained)
        std = math.sqrt(sum((a - mean) ** 2 for a in trained) / (len(trained) - 1) + 1e-8)
    for s, a, r, v, m in zip(samples, adv, ret, values, masks, strict=True):
        whitened = [(x - mean) / std if k else 0.0 for x, k in zip(a, m, strict=True)]
        assert s.advantage == pytest.approx(whitened, rel=1e-9, abs=1e-9)
        assert s.returns == pytest.approx(
            [x if k else 0.0 for x, k in zip(r, m, strict=True)], abs=1e-12
        )
        assert s.old_values == v
    trains = _step_calls(events, "train")
    assert {id(s) for c in trains for s in c.samples} == {id(s) for s in samples}


def check_advantages(run: FakeRun, events) -> None:
    alg = run.cfg.algorithm
    if alg.advantage == "gae":
        check_gae_advantages(run, events)
        return
    estimator = alg.advantage or POLICY_LOSSES[alg.loss].advantage_estimator
    expected: dict[tuple, float] = {}
    for call in _step_calls(events, "generate"):
        for group in call.groups:
            advs = expected_advantages(
                group_rewards(run, group), estimator == "group_mean_std", alg.advantage_eps
            )
            for s, a in zip(group, advs, strict=True):
                expected[_key(s)] = a
    for call in _step_calls(events, "train"):
        for s in call.samples:
            assert s.advantage == pytest.approx(expected[_key(s)], rel=1e-5, abs=1e-5)


def check_losses(run: FakeRun, events) -> None:
    for call in _step_calls(events, "train"):
        assert call.metrics["loss"] == call.loss_value
        assert call.loss_value == pytest.approx(reference_loss(run.policy, call), rel=TOL, abs=TOL)


# -- every loss x mismatch correction ----------------------------------------------------------


def test_reference_covers_every_registered_loss():
    assert set(AGGREGATION) == set(POLICY_LOSSES)
    assert {n for n, s in POLICY_LOSSES.items() if s.aggregation == "sequence"} == (
        SEQUENCE_RATIO_LOSSES
    )


def test_mismatch_support_refuses_only_token_weights_for_sequence_ratio_losses():
    for loss in POLICY_LOSSES:
        for mode in MODES:
            for level in LEVELS:
                refused = mismatch_support(loss, mode, level) is not None
                expected = loss in SEQUENCE_RATIO_LOSSES and mode != "none" and level == "token"
                assert refused == expected, (loss, mode, level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_loss_with_mismatch_correction(composer, tokenizer, loss, mode, level):
    overrides = (
        f"algorithm={loss}",
        "algorithm.dynamic_sampling=none",  # the dapo preset's; dynamic sampling is tested below
        f"algorithm.mismatch={mode}",
        f"algorithm.mismatch_level={level}",
    )
    refused = loss in SEQUENCE_RATIO_LOSSES and mode != "none" and level == "token"
    if refused:
        with pytest.raises(ConfigError) as err:
            composer.resolve(*overrides)
        message = str(err.value)
        for key in ("algorithm.mismatch=", "algorithm.mismatch_level=token", "algorithm.loss="):
            assert key in message
        assert "one importance weight per sequence" in message  # the reason
        return
    run = run_fake(composer, tokenizer, *overrides, noise=MISMATCH_NOISE)
    alg = run.cfg.algorithm
    steps = run.journal.steps()
    assert len(steps) == 2 and [s for s, _ in run.log.records] == [1, 2]
    corrected_run = items_run = 0
    for events, (_, metrics) in zip(steps, run.log.records, strict=True):
        corrected = items = 0
        (forward,) = _step_calls(events, "forward", "policy")
        position = {id(s): i for i, s in enumerate(forward.samples)}
        rollout_logprobs = {}
        for call in _step_calls(events, "generate"):
            for s in (s for g in call.groups for s in g):
                rollout_logprobs.setdefault(_key(s), []).append(s.logprobs)
        trains = _step_calls(events, "train")
        samples = [s for c in trains for s in c.samples]
        for s in samples:
            assert s.old_logprobs == forward.result.logprobs[position[id(s)]].tolist()
            assert s.rollout_logprobs in rollout_logprobs[_key(s)]
            if mode == "none":
                assert s.is_weights is None
                continue
            expected = expected_is_weights(s, alg)
            if level == "token":
                assert isinstance(s.is_weights, list) and len(s.is_weights) == len(s.response_ids)
                assert s.is_weights == pytest.approx(expected, rel=1e-12, abs=1e-12)
            else:
                assert isinstance(s.is_weights, float)
                assert s.is_weights == pytest.approx(expected, rel=1e-12)
                expected = [expected]
            raw = raw_is_weights(s, level)
            items += len(raw)
            corrected += sum(w != r for w, r in zip(expected, raw, strict=True))
        check_losses(run, events)
        check_advantages(run, events)
        assert metrics["actor/loss"] == pytest.approx(np.mean([c.loss_value for c in trains]))
        assert "reward/mean" in metrics
        correction_keys = {
            "mismatch/mismatch_kl",
            "mismatch/mismatch_is_weight_mean",
            "mismatch/mismatch_corrected_fraction",
        }
        if mode == "none":
            assert not correction_keys & set(metrics)
        else:
            assert correction_keys <= set(metrics)
            flat = [
                w for s in samples for w in (s.is_weights if level == "token" else [s.is_weights])
            ]
            assert metrics["mismatch/mismatch_is_weight_mean"] == pytest.approx(np.mean(flat))
            assert metrics["mismatch/mismatch_is_weight_max"] == pytest.approx(max(flat))
            assert metrics["mismatch/mismatch_corrected_fraction"] == pytest.approx(
                corrected / items
            )
        corrected_run += corrected
        items_run += items
    if mode != "none":  # the noise is large enough that corrections apply, but not everywhere
        assert 0 < corrected_run < items_run


# -- old log-probs x routing replay x KL x dynamic sampling ------------------------------------


@pytest.mark.parametrize("dynamic", ["none", "dapo", "dupo"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["kl0", "kl0.1"])
@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
@pytest.mark.parametrize("old", ["recompute", "rollout"])
def test_rl_options(composer, tokenizer, old, replay, kl_coef, dynamic):
    run = run_fake(
        composer,
        tokenizer,
        f"algorithm.old_logprobs={old}",
        f"algorithm.routing_replay={replay}",
        f"algorithm.kl_coef={kl_coef}",
        f"algorithm.dynamic_sampling={dynamic}",
    )
    cfg, alg = run.cfg, run.cfg.algorithm
    wanted, group_size = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    steps = run.journal.steps()
    assert len(steps) == 2
    # The rollout engine gets the trainer's weights before the first generation (version 0).
    assert [c.version for c in run.journal.calls("update_weights")] == [0, 1, 2]
    assert run.journal.events[0][0] == "update_weights"
    assert run.log.rewinds == [0] and sorted(run.checkpoints.saved) == [2]
    assert run.watchdog.started == run.watchdog.stopped == 1
    rollout_differs = False
    for step, events in enumerate(steps, start=1):
        metrics = dict(run.log.records[step - 1][1])
        gens = _step_calls(events, "generate")
        forwards = _step_calls(events, "forward", "policy")
        references = _step_calls(events, "forward", "reference")
        trains = _step_calls(events, "train")
        samples = [s for c in trains for s in c.samples]

        # Phases in order: generate (+ refills), old-policy forward, reference, minibatches, sync.
        kinds = " ".join(k if k != "forward" else c.engine for k, c in events)
        assert re.fullmatch(r"(generate )+(policy )?(reference )?(train )*update_weights", kinds)

        # Dynamic sampling: which groups were trained, and how often.
        groups = [g for c in gens for g in c.groups]
        informative = [max(r) > min(r) for r in (group_rewards(run, g) for g in groups)]
        if dynamic == "dapo":
            rounds, found = 0, sum(informative[:wanted])
            while found < wanted and rounds < alg.max_refill_rounds:
                rounds += 1
                found += sum(informative[rounds * wanted : (rounds + 1) * wanted])
            assert len(gens) == rounds + 1
            assert metrics["sampling/refill_rounds"] == rounds
            kept = [g for g, keep in zip(groups, informative, strict=True) if keep][:wanted]
            trained = Counter(_key(s) for s in samples)
            assert trained == Counter(_key(s) for g in kept for s in g)
        elif dynamic == "dupo":
            assert len(gens) == 1
            kept = [g for g, keep in zip(groups, informative, strict=True) if keep][:wanted]
            trained = Counter(_key(s) for s in samples)
            if not kept:  # nothing to learn from: nothing is trained, as with DAPO
                assert not samples
                continue
            copies = []
            for g in kept:
                first = _key(g[0])
                copies.append(trained[first] // Counter(_key(s) for s in g)[first])
            assert trained == sum(
                (Counter({k: c * v for k, v in Counter(_key(s) for s in g).items()})
                 for g, c in zip(kept, copies, strict=True)),
                Counter(),
            )  # fmt: skip
            assert len(samples) == wanted * group_size
            assert min(copies) >= 1 and max(copies) - min(copies) <= 1
        else:
            assert len(gens) == 1
            assert Counter(_key(s) for s in samples) == Counter(_key(s) for g in groups for s in g)
        assert metrics["sampling/groups_used"] * group_size == len(samples)

        # Optimizer steps per RL step, and the minibatches' partition of the batch.
        assert len(trains) == min(alg.num_minibatches, len(samples))
        assert metrics["actor/optimizer_steps"] == len(trains)
        sizes = [len(c.samples) for c in trains]
        assert not sizes or max(sizes) - min(sizes) <= 1
        if forwards:
            assert sorted(map(id, samples)) == sorted(map(id, forwards[0].samples))

        # Old log-probs, routes and the replay flag.
        if not samples:
            assert not forwards and not references
            continue
        model = ReferenceModel(run.policy, trains[0].params_before)
        needs_forward = old == "recompute" or replay == "r2"
        assert len(forwards) == int(needs_forward)
        if forwards:
            (forward,) = forwards
            position = {id(s): i for i, s in enumerate(forward.samples)}
            assert forward.record_routes == (replay == "r2" or old == "recompute")
            assert forward.replay_routes == (replay == "r3")
        generated = {}
        for s in (s for g in groups for s in g):
            generated.setdefault(_key(s), []).append(s)
        for s in samples:
            exact = model.logprobs(s, replay == "r3")
            if old == "recompute":
                assert s.old_logprobs == forward.result.logprobs[position[id(s)]].tolist()
                assert s.old_logprobs == pytest.approx(exact, rel=1e-12, abs=1e-12)
            else:
                assert s.old_logprobs == s.rollout_logprobs
                assert s.rollout_logprobs in [g.logprobs for g in generated[_key(s)]]
                rollout_differs |= not np.allclose(s.old_logprobs, exact, rtol=0, atol=1e-6)
            if replay == "r3":
                assert np.array_equal(s.routed_experts, generated[_key(s)][0].routed_experts)
            elif forwards:  # r2; off records routes for the route metrics when it runs anyway
                assert np.array_equal(s.routed_experts, forward.result.routes[position[id(s)]])
            else:
                assert s.routed_experts is None
        assert {c.replay_routes for c in trains} == {replay != "off"}
        if replay == "r3":  # the rollout routes differently: R2 and R3 are told apart
            assert any(model.logprobs(s, False) != model.logprobs(s, True) for s in samples)

        # KL to the initial policy.
        if kl_coef:
            (reference,) = references
            ref_position = {id(s): i for i, s in enumerate(reference.samples)}
            for s in samples:
                assert s.ref_logprobs == reference.result.logprobs[ref_position[id(s)]].tolist()
            assert all("kl_ref" in c.metrics for c in trains)
            if step == 1:
                if replay != "r3":  # R3: test_kl_reference_starts_at_zero_under_r3
                    assert trains[0].metrics["kl_ref"] == 0.0
                initial = trains[0].params_before
                assert all((run.reference.state_dict()[k] == v).all() for k, v in initial.items())
        else:
            assert not references and all(s.ref_logprobs is None for s in samples)
            assert all("kl_ref" not in c.metrics for c in trains)
        check_losses(run, events)
        check_advantages(run, events)
    if old == "rollout":
        assert rollout_differs  # the rollout's log-probs are not the policy's


# -- refusals, model kinds, metrics, resume --------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "keys", "reason"),
    [
        (
            ("model=tiny_dense", "algorithm.routing_replay=r2"),
            ["algorithm.routing_replay"],
            "needs a Mixture-of-Experts model",
        ),
        (
            ("model=tiny_dense", "algorithm.routing_replay=r3"),
            ["algorithm.routing_replay"],
            "needs a Mixture-of-Experts model",
        ),
        (
            ("algorithm.mismatch=tis", "algorithm.old_logprobs=rollout"),
            ["algorithm.mismatch=tis", "algorithm.old_logprobs=recompute"],
            "no train/rollout mismatch to correct",
        ),
        (
            ("algorithm.dynamic_sampling=dapo_v2",),
            ["algorithm.dynamic_sampling='dapo_v2'"],
            "is not one of ['none', 'dapo', 'dupo']",
        ),
        (
            ("algorithm.num_minibatches=3",),
            ["algorithm.num_minibatches=3", "rollout.prompts_per_step*group_size = 16"],
            "must split evenly",
        ),
    ],
    ids=["dense-r2", "dense-r3", "mismatch-with-rollout-logprobs", "unknown-sampling", "uneven"],
)
def test_refused_combinations_name_their_keys(composer, overrides, keys, reason):
    with pytest.raises(ConfigError) as err:
        composer.resolve(*overrides)
    for key in (*keys, reason):
        assert key in str(err.value)


@pytest.mark.parametrize("old", ["recompute", "rollout"])
def test_dense_model_has_no_routes(composer, tokenizer, old):
    run = run_fake(composer, tokenizer, "model=tiny_dense", f"algorithm.old_logprobs={old}")
    assert not run.policy.model_config.is_moe
    for events in run.journal.steps():
        forwards = _step_calls(events, "forward", "policy")
        assert len(forwards) == int(old == "recompute")
        assert all(f.result.routes is None for f in forwards)
        trains = _step_calls(events, "train")
        assert all(s.routed_experts is None for c in trains for s in c.samples)
        assert all(not c.replay_routes for c in trains)
        check_losses(run, events)
    assert not any(k.startswith("moe/") for _, m in run.log.records for k in m)


@pytest.mark.parametrize("algorithm", ["gspo", "grpo", "ppo"])  # sequence, seq_mean, token
def test_entropy_bonus_is_in_the_loss(composer, tokenizer, algorithm):
    run = run_fake(composer, tokenizer, f"algorithm={algorithm}", "algorithm.entropy_coef=0.05")
    trains = [c for events in run.journal.steps() for c in _step_calls(events, "train")]
    assert trains and all(c.loss.entropy_coef == 0.05 for c in trains)
    for events in run.journal.steps():
        check_losses(run, events)


def test_routes_are_not_recorded_without_route_metrics(composer, tokenizer):
    run = run_fake(composer, tokenizer, "logging.moe_route_metrics=false")
    for events in run.journal.steps():
        (forward,) = _step_calls(events, "forward", "policy")
        assert not forward.record_routes and forward.result.routes is None
        assert all(
            s.routed_experts is None for c in _step_calls(events, "train") for s in c.samples
        )


COSTLY = ("actor/entropy", "moe/max_expert_load_over_mean", "moe/route_flips",
          "moe/route_change_fraction", "mismatch/k3_kl")  # fmt: skip


def test_costly_metrics_only_on_their_steps(composer, tokenizer):
    """logging.costly_metrics_every=2 over 5 steps: the entropy, the route metrics (no routes
    recorded in the old-policy forward, none compared in training) and the mismatch metrics on
    steps 2, 4 and the last only; the losses and every other metric as on every step."""
    run = run_fake(
        composer, tokenizer, "trainer.steps=5", "logging.costly_metrics_every=2",
        "stability.sentinel.entropy_fraction=0",
    )  # fmt: skip
    every_step = run_fake(composer, tokenizer, "trainer.steps=5")
    assert [s for s, _ in run.log.records] == [1, 2, 3, 4, 5]
    for (step, metrics), events, (_, full) in zip(
        run.log.records, run.journal.steps(), every_step.log.records, strict=True
    ):
        due = step in (2, 4, 5)
        (forward,) = _step_calls(events, "forward", "policy")
        assert forward.record_routes == due
        trains = _step_calls(events, "train")
        assert all((s.routed_experts is not None) == due for c in trains for s in c.samples)
        check_losses(run, events)
        for key in COSTLY:
            assert (key in metrics) == due, (step, key)
        assert metrics["actor/loss"] == full["actor/loss"]
        # what is left out: the costly metrics, per layer too, and the sentinel's entropy EMA
        left_out = {k for k in full if not k.startswith(("time/", "perf/"))} - set(metrics)
        assert all(
            k.startswith(("actor/entropy", "moe/", "mismatch/", "stability/entropy"))
            for k in left_out
        ), left_out


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_costly_metrics_interval_under_routing_replay(composer, tokenizer, replay):
    """Under R2 the old-policy forward records the routes at every step (the replay needs them),
    under R3 they come from the rollout: the interval leaves out only the metrics, and every
    step trains as with the metrics on."""
    steps = ("trainer.steps=3", f"algorithm.routing_replay={replay}")
    run = run_fake(
        composer, tokenizer, *steps, "logging.costly_metrics_every=3",
        "stability.sentinel.entropy_fraction=0",
    )  # fmt: skip
    every_step = run_fake(composer, tokenizer, *steps)
    for (step, metrics), events, (_, full) in zip(
        run.log.records, run.journal.steps(), every_step.log.records, strict=True
    ):
        trains = _step_calls(events, "train")
        assert trains and all(c.replay_routes for c in trains)
        assert all(s.routed_experts is not None for c in trains for s in c.samples)
        check_losses(run, events)
        assert metrics["actor/loss"] == full["actor/loss"]
        costly = [k for k in metrics if k.startswith(("moe/", "mismatch/", "actor/entropy"))]
        assert bool(costly) == (step == 3), (step, costly)


def test_entropy_is_measured_once_a_step_by_the_old_policy_forward(composer, tokenizer):
    """actor/entropy is π_old's mean entropy over the trained tokens (float64 reference from
    the forward's per-token entropies and the loss masks, the overlong filter's holes
    included), taken in the old-policy forward: no optimizer step measures it again. Without an
    old-policy forward (rollout log-probs) the optimizer steps measure it, as before."""
    run = run_fake(composer, tokenizer, "trainer.steps=2", "algorithm=dapo")
    for (_, metrics), events in zip(run.log.records, run.journal.steps(), strict=True):
        (forward,) = _step_calls(events, "forward", "policy")
        assert forward.with_entropy
        total = count = 0.0
        for sample, ent in zip(forward.samples, forward.result.entropy, strict=True):
            mask = [1.0] * len(ent) if sample.loss_mask is None else sample.loss_mask
            total += sum(float(e) * m for e, m in zip(ent, mask, strict=True))
            count += sum(mask)
        assert metrics["actor/entropy"] == pytest.approx(total / count, rel=1e-12)
        trains = _step_calls(events, "train")
        assert trains and all("entropy" not in c.metrics for c in trains)
        assert any(s.loss_mask is not None and 0.0 in s.loss_mask for s in forward.samples)
    run = run_fake(composer, tokenizer, "trainer.steps=2", "algorithm.old_logprobs=rollout")
    for (_, metrics), events in zip(run.log.records, run.journal.steps(), strict=True):
        assert not any(c.with_entropy for c in _step_calls(events, "forward", "policy"))
        trains = _step_calls(events, "train")
        assert metrics["actor/entropy"] == pytest.approx(
            np.mean([c.metrics["entropy"] for c in trains]), rel=1e-12
        )


def test_costly_metrics_a_stability_check_reads_stay_every_step(composer, tokenizer):
    """The sentinel's entropy signal and the mismatch budget read actor/entropy,
    mismatch/k3_kl and moe/route_flips at every step: those (the route metrics together) are
    computed every step."""
    run = run_fake(
        composer, tokenizer, "trainer.steps=3", "logging.costly_metrics_every=4",
        "stability.mismatch_budget.k3_kl=1.0", "stability.mismatch_budget.route_flips=0.9",
    )  # fmt: skip
    for step, metrics in run.log.records:
        for key in ("actor/entropy", "mismatch/k3_kl", "moe/route_flips"):
            assert key in metrics, (step, key)


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_metrics_add_no_forward(composer, tokenizer, replay):
    """The route, expert-load and mismatch metrics ride on forwards the step runs anyway: with
    the rollout's log-probs a step runs no policy forward at all (the expert load comes from
    the rollout's routes under R3), and no reference forward without a KL term; with
    recomputed log-probs, exactly one (counted calls, every step)."""
    for old in ("rollout", "recompute"):
        run = run_fake(
            composer, tokenizer, f"algorithm.old_logprobs={old}",
            f"algorithm.routing_replay={replay}",
        )  # fmt: skip
        for events in run.journal.steps():
            assert len(_step_calls(events, "forward", "policy")) == int(old == "recompute")
            assert _step_calls(events, "forward", "reference") == []
        records = [m for _, m in run.log.records]
        assert all("actor/entropy" in m and "actor/grad_norm" in m for m in records)
        if replay == "r3" or old == "recompute":
            assert all("moe/max_expert_load_over_mean" in m for m in records)


def test_step_metrics(composer, tokenizer):
    run = run_fake(
        composer, tokenizer, "algorithm.mismatch=tis", "algorithm.mismatch_level=sequence"
    )
    for events, (_, metrics) in zip(run.journal.steps(), run.log.records, strict=True):
        trains = _step_calls(events, "train")
        rewards = [r for c in _step_calls(events, "generate") for g in c.groups
                   for r in group_rewards(run, g)]  # fmt: skip
        assert metrics["reward/mean"] == pytest.approx(np.mean(rewards), rel=1e-6)
        assert metrics["actor/loss"] == pytest.approx(np.mean([c.loss_value for c in trains]))
        assert metrics["actor/lr"] == run.policy.lr
        for key in ("actor/clip_fraction", "actor/grad_norm", "actor/entropy",
                    "mismatch/logprob_abs_diff_mean", "mismatch/mismatch_kl",
                    "moe/max_expert_load_over_mean", "moe/route_change_fraction",
                    "moe/route_change_fraction_after_1_updates", "time/train",
                    "sampling/groups_zero_variance", "response/length_mean"):  # fmt: skip
            assert key in metrics, key
        assert "actor/num_microbatches" not in metrics and "actor/skipped" not in metrics
    assert run.log.summaries == [run.last] and run.last == run.log.records[-1][1]


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_empty_responses_are_scored_counted_and_not_trained(composer, tokenizer, replay):
    cfg, model, layout = composer.resolve(
        "trainer.steps=1", f"algorithm.routing_replay={replay}", "algorithm.kl_coef=0.1"
    )
    run = build_fake_run(cfg, model, layout, tokenizer)
    generate = run.rollout.generate

    def aborting_two(prompts, n, params):
        # The first two responses end as aborted requests that produced no token.
        groups = generate(prompts, n, params)
        for sample in groups[0][:2]:
            sample.response_ids, sample.logprobs, sample.finish_reason = [], [], "abort"
            if sample.routed_experts is not None:
                sample.routed_experts = sample.routed_experts[: len(sample.prompt_ids) - 1]
        return groups

    run.rollout.generate = aborting_two
    run.train()
    _, metrics = run.log.records[0]
    responses = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert metrics["response/empty_count"] == 2
    assert metrics["response/length_min"] == 0
    trained = [s for c in run.journal.calls("train") for s in c.samples]
    assert len(trained) == responses - 2 and all(s.response_ids for s in trained)
    forwarded = [s for c in run.journal.calls("forward") for s in c.samples]
    assert forwarded and all(s.response_ids for s in forwarded)


@pytest.mark.parametrize(
    "what, rollout, kl_coef",
    [("optimizer", "embedded", 0.0), ("all", "embedded", 0.1), ("all", "sglang", 0.1)],
)
def test_offload_during_rollout_brackets_generation(composer, tokenizer, what, rollout, kl_coef):
    overrides = ["trainer.steps=2", f"trainer.offload_during_rollout={what}",
                 f"algorithm.kl_coef={kl_coef}"]  # fmt: skip
    if rollout == "sglang":
        overrides.append("rollout=sglang")  # the fake rollout engine stands in for the servers
    raw = composer.raw(*SMALL, *overrides)
    if rollout == "sglang":
        raw["rollout"]["sglang"]["urls"] = ["http://127.0.0.1:1"]
    cfg, model, layout = resolve(raw)
    run = build_fake_run(cfg, model, layout, tokenizer)
    run.train()
    plain = run_fake(composer, tokenizer, "trainer.steps=2", f"algorithm.kl_coef={kl_coef}")
    for events in run.journal.steps():
        kinds = [kind for kind, _ in events]
        first_generate, first_forward = kinds.index("generate"), kinds.index("forward")
        offloads = [c for kind, c in events[:first_generate] if kind == "offload"]
        # The embedded engine generates with the policy's weights: they stay.
        expected = [("policy", what, rollout == "embedded")]
        if what == "all" and kl_coef:
            expected.append(("reference", "all", False))
        assert [(c.engine, c.what, c.keep_weights) for c in offloads] == expected
        reloads = [i for i, kind in enumerate(kinds) if kind == "reload"]
        assert len(reloads) == len(expected)
        assert all(first_generate < i < first_forward for i in reloads)
    assert not run.policy.offloaded
    for (_, metrics), (_, reference) in zip(run.log.records, plain.log.records, strict=True):
        assert metrics["perf/offload_bytes"] > 0 and metrics["perf/reload_bytes"] > 0
        assert "time/offload" in metrics and "time/reload" in metrics
        assert "time/offload" not in reference
        assert metrics["actor/loss"] == reference["actor/loss"]


def test_resume_repeats_the_uninterrupted_run(composer, tokenizer):
    whole = run_fake(composer, tokenizer, "trainer.steps=3", "algorithm.kl_coef=0.1")
    store = MemoryCheckpoints()
    run_fake(composer, tokenizer, "trainer.steps=1", "algorithm.kl_coef=0.1", checkpoints=store)
    resumed = run_fake(
        composer, tokenizer, "trainer.steps=3", "algorithm.kl_coef=0.1", checkpoints=store
    )
    assert resumed.log.rewinds == [1]
    assert [c.version for c in resumed.journal.calls("update_weights")] == [1, 2, 3]
    assert [s for s, _ in resumed.log.records] == [2, 3]
    for (_, a), (_, b) in zip(whole.log.records[1:], resumed.log.records, strict=True):
        for key in ("actor/loss", "reward/mean", "actor/kl_ref", "actor/grad_norm"):
            assert a[key] == b[key], key
    for key, value in whole.policy.state_dict().items():
        assert (resumed.policy.state_dict()[key] == value).all()


def test_a_failed_run_holds_its_signal_handlers_until_close(composer, tokenizer):
    """torchrun SIGTERMs the other ranks the moment one rank exits; a rank whose run failed must
    not die of that signal before it has printed its error, so the handlers go only at close."""
    import signal

    cfg, model, layout = composer.resolve("trainer.steps=2")
    run = build_fake_run(cfg, model, layout, tokenizer)
    before = signal.getsignal(signal.SIGTERM)

    def lose_a_peer():
        raise RuntimeError("peer gone")

    run.trainer._loop = lose_a_peer
    with pytest.raises(RuntimeError, match="peer gone"):
        run.trainer.train()
    held = signal.getsignal(signal.SIGTERM)
    assert held is not before and held is signal.getsignal(signal.SIGINT)
    signal.raise_signal(signal.SIGTERM)
    assert run.trainer.stop_requested
    run.trainer.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is not held


def test_a_stop_signal_writes_nothing_to_the_log_from_its_handler(composer, tokenizer, capfd):
    """The handler may interrupt a write to the run's log (a failing rank logging its traceback
    when torchrun's SIGTERM comes), and logging is not reentrant ("--- Logging error ---"): it
    says so on the terminal with a raw write; the log gets the note when the loop acts on it."""
    import logging
    import signal

    cfg, model, layout = composer.resolve("trainer.steps=2")
    run = build_fake_run(cfg, model, layout, tokenizer)
    records: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    recorder = Recorder()
    logger = logging.getLogger("gspo_megatron")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(recorder)
    try:
        run.trainer._replaced_handlers = run.trainer._install_signal_handlers()
        signal.raise_signal(signal.SIGTERM)
        assert run.trainer.stop_requested and records == []
        assert "signal SIGTERM: checkpointing after this step" in capfd.readouterr().err
        run.trainer._agree(collapse=False)
        assert records == ["signal SIGTERM: checkpointing after this step"]
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
        run.trainer.close()


def test_evaluation(composer, tokenizer):
    run = run_fake(
        composer,
        tokenizer,
        "data.num_eval=8",
        "eval.heldout.problems=6",
        "eval.heldout.samples=2",
        "eval.every=1",
    )
    evals = [c for c in run.journal.calls("generate") if c.params.temperature == 0]
    assert [(len(c.prompts), c.n) for c in evals] == [(6, 2), (6, 2)]  # after steps 1 and 2
    labels = {tuple(p.prompt_ids): p.label for p in run.trainer.benchmarks[0].problems}
    for call, (step, metrics) in zip(evals, run.log.records, strict=True):
        rewards = [
            [partial_credit(_text(run, s), str(labels[tuple(s.prompt_ids)])) for s in g]
            for g in call.groups
        ]
        assert metrics["eval/reward_mean"] == pytest.approx(np.mean(rewards), rel=1e-6)
        accuracy = np.mean([r >= 1.0 for g in rewards for r in g])
        assert metrics["eval/avg@2"] == metrics["eval/pass@1"] == pytest.approx(accuracy)
        assert metrics["eval/pass@2"] == np.mean([max(g) >= 1.0 for g in rewards])
        records = run.log.eval_records[(step, "heldout")]
        np.testing.assert_allclose([r["rewards"] for r in records], rewards, rtol=1e-6)


def test_named_benchmark_in_the_loop(composer, tokenizer, tmp_path):
    """A benchmark file read with its own keys and scored by its own reward, 3 samples at
    temperature 1, logged as eval/<name>/..., against pass@k and maj@k counted here."""
    path = tmp_path / "bench.jsonl"
    rows = [{"question": f"copy:{d}=", "answer": d} for d in ("12", "345", "67", "890", "11")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = composer.raw(*SMALL, "data.num_eval=0", "eval.every=2")
    raw["eval"]["benchmarks"] = {  # as '+eval.benchmarks.digits={...}' gives it
        "digits": {
            "files": [str(path)],
            "samples": 3,
            "ks": [2, 3],
            "temperature": 1.0,
            "data": {"prompt_key": "question", "label_key": "answer"},
            "reward": {"name": "trainer.fakes:StartsWithDigit"},
        }
    }
    run = build_fake_run(*resolve(raw), tokenizer)
    run.train()
    [call] = [c for c in run.journal.calls("generate") if c.n == 3]
    assert [p.label for p in run.trainer.benchmarks[0].problems] == [r["answer"] for r in rows]
    texts = [[_text(run, s) for s in g] for g in call.groups]
    solved = [[int(t[:1].isdigit()) for t in g] for g in texts]
    assert 0 < np.mean(solved) < 1, texts  # a test that can tell
    step, metrics = run.log.records[-1]
    assert step == 2 and "eval/pass@1" not in metrics  # no held-out prompts
    m = {k.removeprefix("eval/digits/"): v for k, v in metrics.items() if "digits" in k}
    assert m["avg@3"] == pytest.approx(np.mean(solved)) and "pass@1" not in m  # ks: 2, 3
    # pass@2 of one problem: 1 - C(n-c, 2) / C(3, 2)
    assert m["pass@2"] == pytest.approx(np.mean([1 - math.comb(3 - sum(g), 2) / 3 for g in solved]))
    assert m["pass@3"] == np.mean([max(g) for g in solved])
    for k in (2, 3):
        majority = [  # ties: the answer seen first
            Counter(t[:1] for t in g[:k] if t).most_common(1)[0][0].isdigit() for g in texts
        ]
        assert m[f"maj@{k}"] == pytest.approx(np.mean(majority))
    assert m["problems"] == 5 and m["reward_failures"] == 0
    assert [r["responses"] for r in run.log.eval_records[(2, "digits")]] == texts


def _text(run: FakeRun, sample) -> str:
    ids = sample.response_ids
    if sample.finish_reason == "stop" and ids[-1] == run.tokenizer.eos_token_id:
        ids = ids[:-1]
    return run.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("old", ["recompute", "rollout"])
def test_kl_reference_starts_at_zero_under_r3(composer, tokenizer, old):
    run = run_fake(
        composer,
        tokenizer,
        "algorithm.routing_replay=r3",
        "algorithm.kl_coef=0.1",
        f"algorithm.old_logprobs={old}",
        "trainer.steps=1",
    )
    first = run.journal.calls("train")[0]
    assert first.metrics["kl_ref"] == 0.0


def test_fast_composition_matches_hydra(composer):
    cases = [
        ("algorithm=dapo", "algorithm.mismatch=tis", "algorithm.kl_coef=0.1",
         "algorithm.routing_replay=off", "seed=3"),
        ("model=tiny_dense", "algorithm.mismatch_level=geometric", "optimizer.lr=0"),
    ]  # fmt: skip
    for overrides in cases:
        assert composer.raw(*SMALL, *overrides) == composer.full(*SMALL, *overrides)
    with pytest.raises(Exception, match="no_such_key"):
        composer.raw("algorithm.no_such_key=1")


def test_no_megatron_core_import():
    """A fake-engine run (config, trainer, collector, rollouts) never imports megatron-core. In a
    fresh interpreter: other test modules import it into this one."""
    code = (
        "import sys\n"
        "from trainer.fakes import SMALL, ConfigComposer, build_fake_run\n"
        "from gspo_megatron.data.tokenizer import load_tokenizer\n"
        "cfg, model, layout = ConfigComposer().resolve(*SMALL, 'trainer.steps=1')\n"
        "build_fake_run(cfg, model, layout, load_tokenizer('char')).train()\n"
        "assert 'megatron.core' not in sys.modules, 'megatron.core was imported'\n"
    )
    tests = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


# -- the Hugging Face export after a checkpoint (trainer.export_hf_every) -----------------------


def test_export_follows_its_checkpoints_every_n_steps_and_at_the_end(composer, tokenizer, capsys):
    from trainer.fakes import FakeExporter

    cfg, model, layout = composer.resolve(
        *SMALL, "trainer.steps=5", "trainer.export_hf_every=2", "trainer.save_every=0"
    )
    exporter = FakeExporter()
    run = build_fake_run(cfg, model, layout, tokenizer, exporter=exporter)
    run.train()
    # an export's step is checkpointed even with save_every=0; the last step is exported too
    assert sorted(run.checkpoints.saved) == [2, 4, 5]
    assert exporter.exports == [2, 4, 5]
    assert capsys.readouterr().err.count("HF export verified (fake)") == 3


def test_an_interrupted_export_is_done_again_on_resume(composer, tokenizer):
    from trainer.fakes import FakeExporter

    overrides = (*SMALL, "trainer.export_hf_every=2", "trainer.save_every=2")
    store, exporter = MemoryCheckpoints(), FakeExporter()
    cfg, model, layout = composer.resolve(*overrides, "trainer.steps=2")
    build_fake_run(cfg, model, layout, tokenizer, checkpoints=store, exporter=exporter).train()
    assert exporter.exports == [2]
    exporter.held.clear()  # killed before the export was listed: a leftover, no export
    exporter.leftovers.add(2)
    cfg, model, layout = composer.resolve(*overrides, "trainer.steps=4")
    build_fake_run(cfg, model, layout, tokenizer, checkpoints=store, exporter=exporter).train()
    assert exporter.exports == [2, 2, 4] and not exporter.leftovers
    # resumed again at 4, whose export is there: nothing to do for it
    cfg, model, layout = composer.resolve(*overrides, "trainer.steps=4")
    build_fake_run(cfg, model, layout, tokenizer, checkpoints=store, exporter=exporter).train()
    assert exporter.exports == [2, 2, 4]


@pytest.mark.parametrize("on_failure", ["continue", "stop"])
def test_a_failed_export_stops_the_run_only_when_asked(composer, tokenizer, on_failure, capsys):
    from trainer.fakes import FakeExporter

    from gspo_megatron.trainer import ExportFailedError

    cfg, model, layout = composer.resolve(
        *SMALL, "trainer.steps=4", "trainer.export_hf_every=2",
        f"trainer.export_hf_on_failure={on_failure}",
    )  # fmt: skip
    run = build_fake_run(cfg, model, layout, tokenizer, exporter=FakeExporter(fail=True))
    if on_failure == "stop":
        with pytest.raises(ExportFailedError, match="export_hf_on_failure=stop"):
            run.train()
        assert sorted(run.checkpoints.saved) == [2]  # the checkpoint itself stays
    else:
        run.train()
        assert [s for s, _ in run.log.records] == [1, 2, 3, 4]
        assert capsys.readouterr().err.count("FAILED verification") == 2
