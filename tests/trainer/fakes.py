"""Fake engines that let `gspo_megatron.trainer.Trainer` run its real loop on CPU in milliseconds:
no megatron-core, no processes, no files.

The policy is a bigram model in float64: the logits of the token after `prev` are
`table[prev]`, plus, for the "MoE" variant, one vector per routed expert of every layer
(`experts[layer, e]`). A fixed router picks each consumed token's experts (top-k of
`router[token, layer]`); replaying given routes swaps them in, so routing replay changes log-probs
as it does in a real MoE. The rollout engine samples from the same weights (as the embedded engine
shares the policy's parameters) but routes with a perturbed router and can add noise to the
log-probs it reports: a train/rollout mismatch on demand.

Every call is recorded, in order, in a shared `Journal`, so a test can check what the trainer
handed to each engine. Everything else the trainer needs is real and cheap: the Hydra config
(composed as gspo-train composes it), the character tokenizer, the synthetic data set, the reward
scorer (inline executor) and the sampler.
"""

from __future__ import annotations

import concurrent.futures
import copy
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from gspo_megatron import CONF_DIR
from gspo_megatron.algorithms.gae import value_loss_terms
from gspo_megatron.algorithms.losses import policy_loss
from gspo_megatron.algorithms.metrics import clip_buckets, finalize_metrics
from gspo_megatron.rollout.base import JobProgress, JobStats, RolloutSample, SamplingParams
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.sample import TrainSample, validate_samples

CONFIG_GROUPS = frozenset(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")

# Small runs: 4 prompts x 4 responses of at most 4 tokens, 2 minibatches, 2 RL steps, no eval.
SMALL = (
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "algorithm.num_minibatches=2",
    "trainer.steps=2",
    "eval.every=0",
    "data.num_train=64",
    "data.num_eval=0",
    "logging.progress=false",
    "logging.tensorboard=false",
)


# -- configuration ---------------------------------------------------------------------------


class ConfigComposer:
    """The config `gspo-train OVERRIDES` composes (`config.compose`), then
    `config.resolve(raw, world_size=1)`.

    A Hydra composition costs 0.1-0.5 s (it reloads every YAML file), too slow for a matrix of
    runs. So each config-group selection (`algorithm=grpo`, `model=tiny_dense`) is composed once,
    as `config.compose` does it, and each value override (`algorithm.kl_coef=0.1`) is applied as
    Hydra applies it: parsed by Hydra's override parser and set with `OmegaConf.update` on the
    composed, schema-typed config (so an unknown key or a wrong type fails, and `0` becomes
    `0.0` for a float), its converted value then copied into the plain dict. `full()` is
    `config.compose`; a test checks that both agree.
    """

    def __init__(self) -> None:
        from gspo_megatron.config import register_schema

        register_schema()
        self._groups: dict[tuple[str, ...], tuple[Any, dict]] = {}
        self._values: dict[tuple[tuple[str, ...], str], tuple[str, Any]] = {}

    def full(self, *overrides: str) -> dict:
        from gspo_megatron.config import compose

        return compose(list(overrides))

    def raw(self, *overrides: str) -> dict:
        from gspo_megatron.config import check_overrides

        check_overrides(list(overrides))
        groups = tuple(o for o in overrides if o.split("=", 1)[0] in CONFIG_GROUPS)
        raw = copy.deepcopy(self._composed(groups)[1])
        for line in overrides:
            if line in groups:
                continue
            key, value = self._value(groups, line)
            *path, last = key.split(".")
            node = raw
            for part in path:
                node = node[part]
            node[last] = copy.deepcopy(value)
        return raw

    def resolve(self, *overrides: str):
        """(RunConfig, ModelConfig, ParallelLayout) for SMALL + overrides, or ConfigError."""
        from gspo_megatron.config import resolve

        return resolve(self.raw(*SMALL, *overrides), 1)

    def _composed(self, groups: tuple[str, ...]) -> tuple[Any, dict]:
        if groups not in self._groups:
            import hydra
            from omegaconf import OmegaConf

            with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = hydra.compose("config", overrides=list(groups))
            self._groups[groups] = (cfg, OmegaConf.to_container(cfg, resolve=True))
        return self._groups[groups]

    def _value(self, groups: tuple[str, ...], line: str) -> tuple[str, Any]:
        """(key, value) of one value override, converted by the composed config's schema."""
        if (groups, line) not in self._values:
            from hydra.core.override_parser.overrides_parser import OverridesParser
            from omegaconf import OmegaConf

            (override,) = OverridesParser.create().parse_overrides([line])
            if override.is_add() or override.is_delete() or override.is_force_add():
                raise ValueError(f"{line}: only plain value overrides here")
            key, cfg = override.key_or_group, self._composed(groups)[0]
            before = OmegaConf.select(cfg, key, throw_on_missing=True)
            if OmegaConf.is_config(before):
                raise ValueError(f"{line}: only overrides of single values here")
            OmegaConf.update(cfg, key, override.value(), merge=True)  # Hydra's own call
            value = OmegaConf.select(cfg, key)
            OmegaConf.update(cfg, key, before, merge=True)
            self._values[(groups, line)] = (key, value)
        return self._values[(groups, line)]


# -- the journal -------------------------------------------------------------------------------


@dataclass
class ForwardCall:
    engine: str  # "policy" or "reference"
    samples: list[TrainSample]
    with_entropy: bool
    record_routes: bool
    replay_routes: bool
    result: FakeForwardResult


@dataclass
class OffloadCall:
    engine: str  # "policy" or "reference"
    what: str | None  # None for a reload
    keep_weights: bool = False


@dataclass
class TrainCall:
    samples: list[TrainSample]
    loss: LossSettings
    replay_routes: bool
    params_before: dict[str, torch.Tensor]  # the weights the loss was computed with
    loss_value: float
    metrics: dict[str, float]


@dataclass
class GenerateCall:
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    groups: list[list[RolloutSample]]


@dataclass
class WeightUpdate:
    source: Any
    version: int


@dataclass
class Journal:
    """Every engine call, in order: ("generate" | "forward" | "train" | "update_weights" |
    "offload" | "reload" | "close", call)."""

    events: list[tuple[str, Any]] = field(default_factory=list)

    def add(self, kind: str, call: Any) -> None:
        self.events.append((kind, call))

    def calls(self, kind: str, engine: str | None = None) -> list[Any]:
        return [
            c
            for k, c in self.events
            if k == kind and (engine is None or getattr(c, "engine", None) == engine)
        ]

    def steps(self) -> list[list[tuple[str, Any]]]:
        """The events of each RL step: each step ends with the weight sync to the rollout engine
        (a resume's sync, with nothing before it, starts no step)."""
        out, current = [], []
        for kind, call in self.events:
            current.append((kind, call))
            if kind == "update_weights":
                if len(current) > 1:
                    out.append(current)
                current = []
        return out


# -- the policy --------------------------------------------------------------------------------


@dataclass
class FakeForwardResult:
    logprobs: list[np.ndarray] | None = None
    values: list[np.ndarray] | None = None  # a value model's
    entropy: list[np.ndarray] | None = None
    routes: list[np.ndarray] | None = None  # int16 [len-1, layers, top_k], as the real engine


class FakePolicy:
    """A bigram (+ routed experts) policy with the training engine's interface.

    Args:
        model_config: the resolved ModelConfig (vocab_size, is_moe, num_experts, top-k, layers).
        layout: the resolved ParallelLayout (the trainer reads `dp`).
        max_sequence_length: samples longer than this are refused (as the engine does).
        lr: plain SGD step size.
        favoured: token id -> how much higher its logits start (digits and <eos> make the
            synthetic reward vary within groups, so dynamic sampling has something to filter).
    """

    def __init__(
        self,
        model_config,
        layout,
        *,
        max_sequence_length: int = 64,
        lr: float = 0.5,
        seed: int = 0,
        favoured: dict[int, float] | None = None,
        journal: Journal | None = None,
        name: str = "policy",
    ) -> None:
        self.model_config = model_config
        self.layout = layout
        self.max_sequence_length = max_sequence_length
        self.lr = lr
        self.lr_scale = 1.0
        self.name = name
        self.trainable = True
        self.journal = journal if journal is not None else Journal()
        self.steps_done = 0
        self.offloaded = False
        g = torch.Generator().manual_seed(seed)
        vocab = model_config.vocab_size
        table = 0.5 * torch.randn(vocab, vocab, generator=g, dtype=torch.float64)
        for token, bias in (favoured or {}).items():
            table[:, token] += bias
        self.table = torch.nn.Parameter(table)
        self.router = None
        self.experts = None
        if model_config.is_moe:
            layers, num = model_config.num_hidden_layers, model_config.num_experts
            self.router = torch.randn(vocab, layers, num, generator=g, dtype=torch.float64)
            self.experts = torch.nn.Parameter(
                0.5 * torch.randn(layers, num, vocab, generator=g, dtype=torch.float64)
            )
            self.own_routes = top_k_routes(self.router, model_config.num_experts_per_tok)
            self.own_counts = route_counts(self.own_routes, num)

    # -- the model -----------------------------------------------------------------------------

    def offload(self, what: str, *, keep_weights: bool) -> dict[str, float]:
        self.journal.add("offload", OffloadCall(self.name, what, keep_weights))
        self.offloaded = True
        return {"offload_bytes": float(sum(p.numel() * 8 for p in self.parameters()))}

    def reload(self) -> dict[str, float]:
        self.journal.add("reload", OffloadCall(self.name, None))
        was, self.offloaded = self.offloaded, False
        return {"reload_bytes": float(sum(p.numel() * 8 for p in self.parameters()))} if was else {}

    def _check_resident(self) -> None:
        if self.offloaded:
            raise RuntimeError(f"the {self.name}'s state is offloaded")

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in (self.table, self.experts) if p is not None]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"table": self.table.detach().clone()}
        if self.experts is not None:
            out["experts"] = self.experts.detach().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.table.copy_(state["table"])
            if self.experts is not None:
                self.experts.copy_(state["experts"])

    def logit_rows(self, tokens: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        """[..., vocab] logits after each consumed token; routes [..., layers, top_k] (MoE
        only; None: the policy's own router)."""
        rows = self.table[tokens]
        if self.experts is None:
            return rows
        if routes is None:
            counts = self.own_counts[tokens]
        else:
            counts = route_counts(routes, self.experts.shape[1])
        return rows + counts @ self.experts.flatten(0, 1)

    def _batch(self, samples: Sequence[TrainSample], replay_routes: bool):
        """Padded [B, T] consumed tokens, next tokens and response mask, and [B, T, L, k]
        routes (replayed from the samples or None)."""
        width = max(len(s.response_ids) for s in samples)
        prev, nxt, mask = [], [], []
        replay = replay_routes and self.experts is not None
        if replay and any(s.routed_experts is None for s in samples):
            raise ValueError("replay_routes needs routed_experts on every sample")
        given = []
        for s in samples:
            ids = s.prompt_ids + s.response_ids
            start, n = len(s.prompt_ids) - 1, len(s.response_ids)
            pad = [0] * (width - n)
            prev.append(ids[start : start + n] + pad)
            nxt.append(ids[start + 1 : start + 1 + n] + pad)
            mask.append(([1.0] * n if s.loss_mask is None else list(s.loss_mask)) + pad)
            if replay:
                rows = np.asarray(s.routed_experts[start : start + n], dtype=np.int64)
                own = self.own_routes[torch.tensor(pad, dtype=torch.long)].numpy()
                given.append(np.concatenate([rows, own]))  # padding: any valid route
        prev_bt = torch.tensor(prev)
        routes = torch.from_numpy(np.stack(given)) if replay else None
        return prev_bt, torch.tensor(nxt), torch.tensor(mask, dtype=torch.float64), routes

    def _token_logprobs(self, prev, nxt, routes) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = torch.log_softmax(self.logit_rows(prev, routes), dim=-1)
        return logp_all.gather(-1, nxt.unsqueeze(-1)).squeeze(-1), logp_all

    # -- the engine interface -------------------------------------------------------------------

    def forward(
        self,
        samples: Sequence[TrainSample],
        *,
        with_entropy: bool = False,
        record_routes: bool = False,
        replay_routes: bool = False,
    ) -> FakeForwardResult:
        self._check_resident()
        validate_samples(samples, self.max_sequence_length)
        if any(isinstance(s.advantage, list) for s in samples):
            # as the real engine: a forward's micro-batches carry one advantage per sequence
            raise ValueError("token-level advantages given to a sequence-level loss")
        with torch.no_grad():
            prev, nxt, _, routes = self._batch(samples, replay_routes)
            logp, logp_all = self._token_logprobs(prev, nxt, routes)
        lengths = [len(s.response_ids) for s in samples]
        result = FakeForwardResult(
            logprobs=[logp[i, :n].numpy().copy() for i, n in enumerate(lengths)]
        )
        if with_entropy:
            ent = -(logp_all.exp() * logp_all).sum(-1)
            result.entropy = [ent[i, :n].numpy().copy() for i, n in enumerate(lengths)]
        if record_routes and self.experts is not None:
            result.routes = []
            for s in samples:
                if replay_routes:
                    result.routes.append(np.asarray(s.routed_experts).astype(np.int16))
                else:
                    ids = torch.tensor(s.prompt_ids + s.response_ids[:-1])
                    result.routes.append(self.own_routes[ids].numpy().astype(np.int16))
        self.journal.add(
            "forward",
            ForwardCall(
                self.name, list(samples), with_entropy, record_routes, replay_routes, result
            ),
        )
        return result

    def train_step(
        self,
        samples: Sequence[TrainSample],
        loss: LossSettings,
        *,
        replay_routes: bool = False,
        entropy_metric: bool = True,
        route_metrics: bool = True,
    ) -> dict[str, float]:
        """One SGD step on the real policy loss of `samples` (the whole minibatch); the entropy
        and route metrics only when asked, as the engine."""
        if not self.trainable:
            raise RuntimeError("a frozen engine (the KL reference) cannot train")
        self._check_resident()
        validate_samples(samples, self.max_sequence_length)
        if any(s.old_logprobs is None for s in samples):
            raise ValueError("train_step needs old_logprobs on every sample")
        if loss.kl_coef and any(s.ref_logprobs is None for s in samples):
            raise ValueError("algorithm.kl_coef > 0 needs reference log-probs on every sample")
        before = self.state_dict()
        prev, nxt, mask, routes = self._batch(samples, replay_routes)
        logp, logp_all = self._token_logprobs(prev, nxt, routes)
        extra: dict[str, Any] = {}
        if loss.kl_coef:
            extra = dict(
                ref_logprobs=_pad([s.ref_logprobs for s in samples], logp.shape),
                kl_coef=loss.kl_coef,
                kl_estimator=loss.kl_estimator,
            )
        ent = -(logp_all.exp() * logp_all).sum(-1)
        if loss.entropy_coef:
            extra |= dict(entropy=ent, entropy_coef=loss.entropy_coef)
        lags = None
        if any(s.version_lags is not None for s in samples):
            lags = _pad([s.version_lags or [0] * len(s.response_ids) for s in samples], logp.shape)
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        value, metrics = policy_loss(
            loss.name,
            logp,
            _pad([s.old_logprobs for s in samples], logp.shape),
            _advantages(samples, logp.shape),
            mask,
            is_weights=_is_weights(samples, logp.shape),
            token_buckets=clip_buckets(lags, lengths, loss.max_new_tokens),
            **loss.hparams,
            **extra,
        )
        for p in self.parameters():
            p.grad = None
        value.backward()
        grads = [p.grad for p in self.parameters()]
        grad_norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
        with torch.no_grad():
            for p, g in zip(self.parameters(), grads, strict=True):
                p -= self.current_lr() * g
        self.steps_done += 1
        with torch.no_grad():
            entropy = float((ent * mask).sum() / mask.sum().clamp(min=1.0))
        out = dict(metrics)
        out.update(
            loss=float(value.detach()),
            lr=self.current_lr(),
            grad_norm=grad_norm,
            skipped=0.0,
            num_microbatches=1.0,
        )
        if entropy_metric or loss.entropy_coef:
            out["entropy"] = entropy
        given = [s.routed_experts for s in samples]
        if (
            self.experts is not None
            and route_metrics
            and not replay_routes
            and all(r is not None for r in given)
        ):
            # The route metric the engine reports when it is given routes it does not replay.
            own = self.own_routes.numpy()
            now = np.concatenate([own[s.prompt_ids + s.response_ids[:-1]] for s in samples])
            then = np.sort(np.concatenate(given), axis=-1)
            out["moe/route_change_fraction"] = float((now != then).any(-1).mean())
        self.journal.add(
            "train",
            TrainCall(list(samples), loss, replay_routes, before, out["loss"], dict(out)),
        )
        return out

    def current_lr(self) -> float:
        return self.lr * self.lr_scale

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale

    def close(self) -> None:
        self.journal.add("close", self.name)

    def frozen_copy(self, name: str = "reference") -> FakePolicy:
        """A frozen engine holding this policy's current weights (the KL reference)."""
        frozen = copy.copy(self)
        frozen.name = name
        frozen.trainable = False
        frozen.table = torch.nn.Parameter(self.table.detach().clone(), requires_grad=False)
        if self.experts is not None:
            frozen.experts = torch.nn.Parameter(self.experts.detach().clone(), requires_grad=False)
        return frozen


@dataclass
class ValueTrainCall:
    samples: list[TrainSample]
    clip: float | None
    params_before: torch.Tensor
    metrics: dict[str, float]


class FakeCritic:
    """PPO's value model in miniature, with the engine's value interface: the value of the
    state before a response token is `table[the token before it]` (float64), trained by SGD on
    the real clipped value loss (algorithms/gae.py) averaged over the minibatch's tokens."""

    def __init__(
        self, vocab_size: int, *, max_sequence_length: int, lr: float, journal: Journal, seed=0
    ) -> None:
        g = torch.Generator().manual_seed(seed + 1)
        self.table = torch.nn.Parameter(0.1 * torch.randn(vocab_size, generator=g).double())
        self.max_sequence_length = max_sequence_length
        self.lr = lr
        self.journal = journal
        self.name = "critic"
        self.value_head = True
        self.steps_done = 0
        self.offloaded = False

    def _values(self, samples: Sequence[TrainSample]) -> torch.Tensor:
        width = max(len(s.response_ids) for s in samples)
        prev = [
            (s.prompt_ids + s.response_ids)[len(s.prompt_ids) - 1 : -1]
            + [0] * (width - len(s.response_ids))
            for s in samples
        ]
        return self.table[torch.tensor(prev)]

    def forward(self, samples: Sequence[TrainSample], **unused) -> FakeForwardResult:
        if self.offloaded:
            raise RuntimeError("the critic's state is offloaded")
        validate_samples(samples, self.max_sequence_length)
        with torch.no_grad():
            values = self._values(samples)
        result = FakeForwardResult(
            values=[values[i, : len(s.response_ids)].numpy().copy() for i, s in enumerate(samples)]
        )
        self.journal.add(
            "forward", ForwardCall(self.name, list(samples), False, False, False, result)
        )
        return result

    def train_value_step(self, samples: Sequence[TrainSample], *, clip: float | None):
        if self.offloaded:
            raise RuntimeError("the critic's state is offloaded")
        validate_samples(samples, self.max_sequence_length)
        shape = (len(samples), max(len(s.response_ids) for s in samples))
        mask = _pad([s.loss_mask or [1.0] * len(s.response_ids) for s in samples], shape)
        terms = value_loss_terms(
            self._values(samples),
            _pad([s.old_values for s in samples], shape),
            _pad([s.returns for s in samples], shape),
            mask,
            clip=clip,
        )
        before = self.table.detach().clone()
        loss = terms.loss_sum / mask.sum().clamp(min=1.0)
        (grad,) = torch.autograd.grad(loss, self.table)
        with torch.no_grad():
            self.table -= self.lr * grad
        self.steps_done += 1
        out = finalize_metrics(terms.metric_sums)
        out.update(
            loss=float(loss.detach()), lr=self.lr, grad_norm=float(grad.norm()), skipped=0.0,
            num_microbatches=1.0,
        )  # fmt: skip
        self.journal.add("value_train", ValueTrainCall(list(samples), clip, before, dict(out)))
        return out

    def offload(self, what: str, *, keep_weights: bool) -> dict[str, float]:
        self.journal.add("offload", OffloadCall(self.name, what, keep_weights))
        self.offloaded = True
        return {"offload_bytes": float(self.table.numel() * 8)}

    def reload(self) -> dict[str, float]:
        self.journal.add("reload", OffloadCall(self.name, None))
        self.offloaded = False
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"table": self.table.detach().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.table.copy_(state["table"])

    def close(self) -> None:
        self.journal.add("close", self.name)


def top_k_routes(router: torch.Tensor, k: int) -> torch.Tensor:
    """[vocab, layers, k]: each token's k highest-scoring experts per layer, in ascending id."""
    return router.topk(k, dim=-1).indices.sort(dim=-1).values


def route_counts(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., layers * experts] float64: how often each (layer, expert) is chosen."""
    one_hot = torch.nn.functional.one_hot(routes.long(), num_experts).sum(-2)
    return one_hot.flatten(-2).to(torch.float64)


def _pad(rows: Sequence[Sequence[float]], shape) -> torch.Tensor:
    width = shape[1]
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)


def _advantages(samples: Sequence[TrainSample], shape) -> torch.Tensor:
    if any(isinstance(s.advantage, list) for s in samples):
        return _pad(
            [
                s.advantage
                if isinstance(s.advantage, list)
                else [s.advantage] * len(s.response_ids)
                for s in samples
            ],
            shape,
        )
    return torch.tensor([float(s.advantage) for s in samples], dtype=torch.float64)


def _is_weights(samples: Sequence[TrainSample], shape) -> torch.Tensor | None:
    """None, [B] (one weight per sequence) or [B, T], as the engine's micro-batches carry them."""
    kinds = {type(s.is_weights) for s in samples}
    if kinds == {type(None)}:
        return None
    if kinds <= {float, int}:
        return torch.tensor([float(s.is_weights) for s in samples], dtype=torch.float64)
    if kinds == {list}:
        return _pad([s.is_weights for s in samples], shape)
    raise ValueError(f"is_weights of mixed kinds in one minibatch: {sorted(map(str, kinds))}")


# -- the rollout engine ------------------------------------------------------------------------


class FakeRollout:
    """Samples from the policy's current weights (shared, as the embedded engine shares them).

    It routes with its own, perturbed router (`route_noise`: the rollout engine's numerics), and
    reports log-probs of the distribution it sampled from plus Gaussian `logprob_noise`. With
    `record_routes` every sample carries the experts of every consumed token (R3).
    """

    generates_on_every_rank = True  # shares the policy, like the embedded engine

    def __init__(
        self,
        policy: FakePolicy,
        *,
        record_routes: bool = False,
        logprob_noise: float = 0.0,
        route_noise: float = 1.0,
        seed: int = 1,
        journal: Journal | None = None,
    ) -> None:
        self.policy = policy
        self.record_routes = record_routes
        self.logprob_noise = logprob_noise
        self.journal = journal if journal is not None else policy.journal
        self.version = 0
        self.closed = False
        self.routes = None
        if policy.router is not None:
            g = torch.Generator().manual_seed(seed)
            noisy = policy.router + route_noise * torch.randn(
                policy.router.shape, generator=g, dtype=torch.float64
            )
            self.routes = top_k_routes(noisy, policy.model_config.num_experts_per_tok)

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        if params.top_p != 1.0 or params.top_k != -1:
            raise NotImplementedError("the fake rollout engine samples without top-p / top-k")
        seed = 0 if params.seed is None else params.seed
        gen = torch.Generator().manual_seed(seed)
        noise_gen = torch.Generator().manual_seed(seed + 1)
        flat = [list(p) for p in prompts for _ in range(n)]
        last = torch.tensor([p[-1] for p in flat])
        done = torch.zeros(len(flat), dtype=torch.bool)
        responses: list[list[int]] = [[] for _ in flat]
        logprobs: list[list[float]] = [[] for _ in flat]
        finish = ["length"] * len(flat)
        stops = set(params.stop_token_ids)
        with torch.no_grad():
            for _ in range(params.max_new_tokens):
                routes = None if self.routes is None else self.routes[last]
                rows = self.policy.logit_rows(last, routes)
                if params.temperature == 0:
                    logp_all = torch.log_softmax(rows, dim=-1)
                    token = logp_all.argmax(-1)
                else:
                    logp_all = torch.log_softmax(rows / params.temperature, dim=-1)
                    token = torch.multinomial(logp_all.exp(), 1, generator=gen).squeeze(-1)
                lp = logp_all.gather(-1, token.unsqueeze(-1)).squeeze(-1)
                noise = self.logprob_noise * torch.randn(len(flat), generator=noise_gen)
                for i in range(len(flat)):
                    if done[i]:
                        continue
                    t = int(token[i])
                    responses[i].append(t)
                    logprobs[i].append(float(lp[i] + noise[i]))
                    if t in stops:
                        done[i] = True
                        finish[i] = "stop"
                last = token
                if bool(done.all()):
                    break
        samples = []
        for prompt, response, lps, reason in zip(flat, responses, logprobs, finish, strict=True):
            routed = None
            if self.record_routes and self.routes is not None:
                consumed = torch.tensor(prompt + response[:-1])
                routed = self.routes[consumed].numpy().astype(np.int32)
            samples.append(
                RolloutSample(prompt, response, lps, reason, self.version, routed_experts=routed)
            )
        groups = [samples[i * n : (i + 1) * n] for i in range(len(prompts))]
        self.journal.add("generate", GenerateCall([list(p) for p in prompts], n, params, groups))
        return groups

    def update_weights(self, source, version: int) -> None:
        self.version = version
        self.journal.add("update_weights", WeightUpdate(source, version))

    def release_kept_context(self) -> None:
        pass  # it keeps nothing between calls

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.closed = True


class FakeGeneratorProcess(FakeRollout):
    """The generator process's interface (rollout.mode one_step_off / async) over FakeRollout.

    Jobs run in order, each as soon as the weights published reach its `min_version` (at
    submission, or at the weight update that brings them): the process's order and staleness
    gate. `swap_after`: each response's tokens after that many are tagged with the next
    version (a partial rollout, to test the mask); `extra_lag`: prompt index -> versions
    subtracted from that group's tokens (an engine that breaks the staleness bound).
    """

    generates_on_every_rank = False
    resync_poll_s = 0.01

    def __init__(self, policy: FakePolicy, **kwargs) -> None:
        super().__init__(policy, **kwargs)
        self.jobs: list[dict] = []
        self.waiting: list[tuple[dict, concurrent.futures.Future]] = []
        self.swap_after: int | None = None
        self.extra_lag: dict[int, int] = {}

    def start_generate(self, prompts, n, params, *, min_version=None, urgent=False, progress=None):
        job = {
            "prompts": [list(p) for p in prompts], "n": n, "params": params,
            "min_version": self.version if min_version is None else min_version,
            "urgent": urgent, "version": None, "progress": progress,
        }  # fmt: skip
        self.jobs.append(job)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.job = job
        self.waiting.insert(0 if urgent else len(self.waiting), (job, future))
        self._run_ready()
        return future

    def snapshot(self, jobs):
        """Jobs run whole when their weights come: each is complete, or not started."""
        out = []
        for future in jobs:
            job = future.job
            if future.done():
                out.append(JobProgress.finished(future.result()))
            else:
                out.append(job["progress"] or JobProgress.empty(job["prompts"], job["n"]))
        return out

    def update_weights(self, source, version: int, urls=None) -> None:
        super().update_weights(source, version)
        self._run_ready()

    def _run_ready(self) -> None:
        while self.waiting and self.waiting[0][0]["min_version"] <= self.version:
            job, future = self.waiting.pop(0)
            job["version"] = self.version
            groups = self.generate(job["prompts"], job["n"], job["params"])
            kept = job["progress"]
            if kept is not None:  # complete samples stay; the fake starts partial ones over
                for p, flags in enumerate(kept.done):
                    for j, done in enumerate(flags):
                        if done:
                            groups[p][j] = kept.samples[p][j]
            for index, group in enumerate(groups):
                for sample in group:
                    versions = [self.version] * len(sample.response_ids)
                    if self.swap_after is not None:
                        cut = min(self.swap_after, len(versions))
                        versions = versions[:cut] + [self.version + 1] * (len(versions) - cut)
                    lag = self.extra_lag.get(index, 0)
                    if sample.token_versions is None or kept is None:
                        sample.token_versions = [v - lag for v in versions]
            future.job_stats = JobStats(
                sampled_tokens=sum(len(s.response_ids) for g in groups for s in g)
            )
            future.set_result(groups)

    def servers_to_resync(self) -> list[str]:
        return []

    def fault_metrics(self) -> dict[str, float]:
        return {}


# -- a rollout backend registered from the tests ---------------------------------------------


def build_fake_server(cfg, policy, run):
    """The fake server backend's engine: FakeGeneratorProcess (a ServerRolloutEngine) sampling
    from the policy's weights; no weight source (it reads the policy)."""
    record = cfg.algorithm.routing_replay == "r3"
    return FakeGeneratorProcess(policy, record_routes=record, logprob_noise=0.05), None


def check_fake_server(cfg) -> None:
    from gspo_megatron.config import ConfigError

    if cfg.rollout.top_p != 1.0 or cfg.rollout.top_k != -1:
        raise ConfigError(
            "rollout.top_p / rollout.top_k with rollout.engine=fake_server: the fake servers "
            "sample without them"
        )


def _fake_server_backend():
    from gspo_megatron.rollout.backends import RolloutBackend, RolloutShare

    return RolloutBackend(
        build=build_fake_server,
        memory_share=lambda rollout: RolloutShare(server_fraction=0.25, fraction_key="fake"),
        keeps_policy_weights=False,
        check=check_fake_server,
        describe=lambda cfg: "rollout: fake servers",
    )


# What a test registers: ROLLOUT_BACKENDS["fake_server"] = "trainer.fakes:FAKE_SERVER_BACKEND".
FAKE_SERVER_BACKEND = _fake_server_backend()


# -- run files ---------------------------------------------------------------------------------


class StartsWithDigit:
    """A benchmark reward for tests: 1 when the response starts with a digit, whose answer is
    its first character (the fake policy's responses start with one about half the time)."""

    inline_safe = True

    def answer(self, response: str) -> str | None:
        return response[:1] or None

    def __call__(self, prompt: str, response: str, label) -> float:
        return float(response[:1].isdigit())


class MemoryLog:
    """MetricsLogger's interface, in memory."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self.rewinds: list[int] = []
        self.summaries: list[dict[str, float]] = []
        self.eval_records: dict[tuple[int, str], list[dict]] = {}
        self.closed = False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.records.append((step, dict(metrics)))

    def write_records(self, step: int, name: str, records: list[dict]) -> None:
        self.eval_records[(step, name)] = list(records)

    def rewind(self, step: int) -> None:
        self.rewinds.append(step)
        self.records = [(s, m) for s, m in self.records if s <= step]

    def summary(self, last: dict[str, float]) -> None:
        self.summaries.append(dict(last))

    def close(self) -> None:
        self.closed = True


class MemoryCheckpoints:
    """RunCheckpoints' interface, in memory: `resume("auto")` loads the newest save; a rollback
    moves the newer saves to `superseded` (step, reason)."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        self.superseded: list[tuple[int, str]] = []
        self.history: list[dict[str, Any]] = []

    def save(
        self, engine: FakePolicy, step: int, state: dict[str, Any], companions, extra_files=None
    ) -> int:
        weights = {"": engine.state_dict()}
        weights.update({name: e.state_dict() for name, e in companions.items()})
        # the files as a checkpoint holds them: torch.save, read back with weights_only
        stored = {}
        for name, obj in (extra_files or {}).items():
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            stored[name] = buffer.getvalue()
        self.saved[step] = (copy.deepcopy(state), weights, stored)
        return step  # the checkpoint's "path"

    def resume(self, engine: FakePolicy, mode: str, companions) -> dict[str, Any] | None:
        if mode == "never" or not self.saved:
            return None
        return self._load(engine, max(self.saved), companions)

    def _load(self, engine, step: int, companions) -> dict[str, Any]:
        state, weights, self._files = self.saved[step]
        self._resumed = step
        for name, e in {"": engine, **companions}.items():
            e.load_state_dict(weights[name])
        return copy.deepcopy(state)

    def read_file(self, name: str):
        return torch.load(io.BytesIO(self._files[name]), weights_only=True)

    @property
    def resumed(self) -> int:
        """The step resumed or rolled back to: the fake's 'path' of a checkpoint is its step."""
        return self._resumed

    def rollbacks(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.history)

    def save_rollbacks(self, records: list[dict[str, Any]]) -> None:
        self.history = copy.deepcopy(records)

    def rollback_target(self, engine, allowed, companions=None):
        for step in sorted(self.saved, reverse=True):
            if allowed(step, self.saved[step][0].get("health")):
                return step, f"step_{step:06d}"
        return None

    def roll_back(self, engine, step: int, *, reason: str, companions=None, validate=True):
        state = self._load(engine, step, companions or {})
        for newer in sorted(s for s in self.saved if s > step):
            del self.saved[newer]
            self.superseded.append((newer, reason))
        return state


class FakeExporter:
    """HFExporter's interface: `exports` lists the checkpoints exported (their steps, which
    MemoryCheckpoints gives as paths), `held` those holding an export, `leftovers` those
    holding an interrupted one; `fail` makes every export fail verification."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.exports: list[int] = []
        self.held: set[int] = set()
        self.leftovers: set[int] = set()

    def export(self, step: int, checkpoint):
        """An ExportResult's `ok` and `message` (the trainer reads nothing else)."""
        self.exports.append(checkpoint)
        self.held.add(checkpoint)
        said = "FAILED verification" if self.fail else "verified"
        return SimpleNamespace(ok=not self.fail, message=f"step {step}: HF export {said} (fake)")

    def present(self, checkpoint) -> bool:
        return checkpoint in self.held

    def clear_leftovers(self, checkpoint) -> list[str]:
        found = checkpoint in self.leftovers
        self.leftovers.discard(checkpoint)
        return ["hf.tmp-fake"] if found else []


class NullWatchdog:
    def __init__(self) -> None:
        self.started = self.stopped = 0

    def start(self) -> None:
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1


# -- assembly ----------------------------------------------------------------------------------


@dataclass
class FakeRun:
    cfg: Any
    trainer: Any
    policy: FakePolicy
    reference: FakePolicy | None
    critic: FakeCritic | None
    rollout: FakeRollout
    log: MemoryLog
    checkpoints: MemoryCheckpoints
    watchdog: NullWatchdog
    journal: Journal
    tokenizer: Any
    train_data: Any
    last: dict[str, float] = field(default_factory=dict)

    def train(self) -> dict[str, float]:
        """Trainer.train(), with the process's signal handlers put back afterwards."""
        import signal

        saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.last = self.trainer.train()
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        return self.last


def build_fake_run(
    cfg,
    model,
    layout,
    tokenizer,
    *,
    logprob_noise: float = 0.05,
    checkpoints: MemoryCheckpoints | None = None,
    log: MemoryLog | None = None,
    lr: float = 0.5,
    rollout_from_backend: bool = False,
    exporter=None,
    run_dir: Path | None = None,
) -> FakeRun:
    """The trainer gspo-train builds (components.build_trainer), with fake engines and stores
    (`checkpoints` and `log`: an earlier run's, to resume it). The rollout engine is a fake one
    of the rollout.mode's kind, or with `rollout_from_backend` the one rollout.engine's backend
    builds (components.build_rollout, keeping its files in `run_dir`)."""
    from gspo_megatron.data.config import build_datasets
    from gspo_megatron.evaluation.benchmarks import build_benchmarks
    from gspo_megatron.ranks import SingleRank
    from gspo_megatron.rewards.registry import build_scorer
    from gspo_megatron.trainer import Trainer

    journal = Journal()
    train_data, eval_data = build_datasets(cfg.data, tokenizer)
    favoured = dict.fromkeys(tokenizer.convert_tokens_to_ids(list("0123456789")), 3.0)
    favoured[tokenizer.eos_token_id] = 4.5
    policy = FakePolicy(
        model,
        layout,
        max_sequence_length=cfg.engine.max_sequence_length,
        lr=lr,
        seed=cfg.seed,
        favoured=favoured,
        journal=journal,
    )
    # The initial policy, frozen, as build_trainer makes it.
    alg = cfg.algorithm
    reference = policy.frozen_copy() if alg.kl_coef > 0 or alg.kl_reward_coef > 0 else None
    critic = None
    if alg.advantage == "gae":
        critic = FakeCritic(
            model.vocab_size,
            max_sequence_length=cfg.engine.max_sequence_length,
            lr=cfg.critic.optimizer.lr,
            journal=journal,
            seed=cfg.seed,
        )
    source = None
    if rollout_from_backend:
        from gspo_megatron.components import build_rollout

        assert run_dir is not None, "a backend's engine needs a run directory"
        rollout, source = build_rollout(cfg, policy, run_dir)
    else:
        from gspo_megatron.rollout.backends import rollout_backend

        # Routes as the configured backend records them (the embedded one: R3, or route metrics)
        record = rollout_backend(cfg.rollout.engine).records_routes(cfg)
        rollout = (FakeRollout if cfg.rollout.mode == "sync" else FakeGeneratorProcess)(
            policy, record_routes=record, logprob_noise=logprob_noise
        )
    run = FakeRun(
        cfg=cfg,
        trainer=None,
        policy=policy,
        reference=reference,
        critic=critic,
        rollout=rollout,
        log=log if log is not None else MemoryLog(),
        checkpoints=checkpoints if checkpoints is not None else MemoryCheckpoints(),
        watchdog=NullWatchdog(),
        journal=journal,
        tokenizer=tokenizer,
        train_data=train_data,
    )
    scorer = build_scorer(cfg.reward)
    run.trainer = Trainer(
        cfg,
        engine=policy,
        rollout=rollout,
        scorer=scorer,
        tokenizer=tokenizer,
        train_data=train_data,
        benchmarks=build_benchmarks(
            cfg, tokenizer, eval_data, scorer, vocab_size=model.vocab_size, seed=cfg.seed
        ),
        ranks=SingleRank(),
        log=run.log,
        checkpoints=run.checkpoints,
        watchdog=run.watchdog,
        weight_source=source,
        reference=reference,
        critic=critic,
        exporter=exporter,
    )
    return run
