"""Policy losses of the GSPO family, each written as per-item terms over a global denominator.

Notation (docs/ALGORITHMS.md): response i has tokens t with mask m_it, new log-probs l_it, old
log-probs o_it, advantage A_i ([B]) or A_it ([B, T]); |y_i| = Σ_t m_it. Every loss is

    L = (Σ over items of term) / D,   D = number of sequences N, or number of response tokens,

with D computed over the whole optimizer step (all micro-batches, all ranks). The engine calls
:func:`policy_loss_terms` per micro-batch and rank, sums ``loss_sum`` and ``denominator`` over all
of them, and divides once; :func:`policy_loss` is the single-batch case.

Context parallelism. A rank may hold only some tokens of a sequence. Every per-sequence partial sum
(|y_i|, Σ_t m(l - o), GMPO's Σ_t m·clipped log r, ...) goes through ``seq_sum`` — stacked into
one [K, B] tensor, one call per :func:`policy_loss_terms` — before any nonlinearity. ``seq_share``
says how much of each sequence this rank owns: terms computed from reduced statistics (GSPO's and
GMPO's per-sequence terms) and the sequence count N are multiplied by it, per-token partial sums
are not (they are already disjoint across ranks).

Clamp. Log-ratios are clamped to [-20, 20] before ``exp`` (ratio in [2.1e-9, 4.9e8]), per token
and, for GSPO/GMPO, after the per-sequence mean. A ratio that far from 1 lies far outside every
clip range; the clamp keeps ``exp`` and its backward finite in float32/bfloat16 whatever the
inputs (exp overflows float32 beyond 88). Where the clamp is active the log-ratio's gradient is 0
(the same clamp as verl's PPO loss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from ._checks import (
    nonfinite_on,
    raise_if_flagged,
    require_number,
    require_shape,
    require_tensor,
    shape,
)
from .kl import KL_ESTIMATORS
from .metrics import CLIP_BUCKET_PREFIX, finalize_metrics, merge_metric_sums

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exponentiation."""

Denominator = Literal["sequences", "tokens"]
Aggregation = Literal["sequence", "seq_mean", "seq_constant", "token"]
SeqSum = Callable[[Tensor], Tensor]


@dataclass
class LossTerms:
    """One micro-batch's (and rank's) share of a policy loss.

    Attributes:
        loss_sum: scalar, differentiable: this share of Σ per-item terms (KL term included).
        denominator: scalar float: this share of the global denominator D (the kind given by
            ``POLICY_LOSSES[name].denominator``). Integral unless ``seq_share`` is fractional.
        metric_sums: detached tensors keyed ``"<metric>/sum|count|max|min"``; reduce each with
            :func:`~gspo_megatron.algorithms.metrics.metric_reduce_op` across micro-batches and
            ranks, then :func:`~gspo_megatron.algorithms.metrics.finalize_metrics`.
    """

    loss_sum: Tensor
    denominator: Tensor
    metric_sums: dict[str, Tensor] = field(default_factory=dict)

    def loss(self) -> Tensor:
        """loss_sum / denominator, or 0 (graph intact, no NaN) when the denominator is 0."""
        safe = torch.where(
            self.denominator > 0, self.denominator, torch.ones_like(self.denominator)
        )
        return self.loss_sum / safe


def sum_loss_terms(parts: list[LossTerms]) -> LossTerms:
    """Add the terms of several micro-batches (or simulated ranks): the global-batch loss."""
    if not parts:
        raise ValueError("parts must hold at least one LossTerms")
    return LossTerms(
        loss_sum=torch.stack([p.loss_sum for p in parts]).sum(),
        denominator=torch.stack([p.denominator for p in parts]).sum(),
        metric_sums=merge_metric_sums(p.metric_sums for p in parts),
    )


# --------------------------------------------------------------------------------------------
# The batch as every loss sees it


@dataclass
class _Batch:
    logp: Tensor  # [B, T] new log-probs, 0 outside the mask, differentiable
    log_ratio: Tensor  # [B, T] l - o, 0 outside the mask, differentiable
    mask: Tensor  # [B, T] bool
    adv: Tensor  # [B] (non-finite -> 0), or [B, T] (0 outside the mask)
    adv_bt: Tensor  # [B, T] view of adv
    cache: dict[str, Tensor] = field(default_factory=dict)  # shared by partials() and terms()

    @property
    def seq_adv(self) -> bool:
        return self.adv.dim() == 1


@dataclass
class _Terms:
    values: Tensor  # [B] per-sequence terms ("sequence") or [B, T] per-token terms
    clipped: Tensor  # [B, T] bool (False outside the mask), or [B] bool for whole sequences
    ratio: Tensor  # detached: [B] sequence ratios or [B, T] token ratios
    seq_clipped: Tensor | None = None  # [B] bool, sequence-level losses only


def _exp_ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, clip_c: float | None
) -> tuple[Tensor, Tensor]:
    """PPO objective min(r·A, clip(r, 1-clip_low, 1+clip_high)·A), dual-clipped below at c·A.

    Written as r_eff·A with r_eff = min(r, 1+clip_high) where A > 0 and max(r, 1-clip_low)
    (then min(·, c)) where A < 0: the same value, with zero gradient exactly where a clip bound is
    selected. Returns (objective, clipped) — clipped: the term's value differs from r·A.
    """
    pos = adv > 0
    upper = ratio.clamp(max=1.0 + clip_high)
    lower = ratio.clamp(min=1.0 - clip_low)
    if clip_c is not None:
        lower = lower.clamp(max=clip_c)
    objective = torch.where(pos, upper, lower) * adv
    with torch.no_grad():
        neg = adv < 0
        clipped = pos & (ratio > 1.0 + clip_high)
        clipped |= neg & (ratio < 1.0 - clip_low)
        if clip_c is not None:
            clipped |= neg & (ratio > clip_c)
    return objective, clipped


def _seq_mean_log(row: Tensor, lengths: Tensor) -> Tensor:
    return (row / lengths.clamp(min=1.0)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# --------------------------------------------------------------------------------------------
# The losses. Each: partials(x, hp) -> per-sequence partial sums ([B] each) to reduce with
# seq_sum; terms(x, hp, lengths, reduced) -> _Terms.


def _no_partials(x: _Batch, hp: Mapping) -> list[Tensor]:
    return []


def _gspo_partials(x: _Batch, hp: Mapping) -> list[Tensor]:
    return [x.log_ratio.sum(-1)]


def _gspo_terms(x: _Batch, hp: Mapping, lengths: Tensor, reduced: list[Tensor]) -> _Terms:
    (lr_sum,) = reduced
    s = torch.exp(_seq_mean_log(lr_sum, lengths))  # gradient reaches every token of sequence i
    objective, clipped = _clipped_surrogate(s, x.adv, hp["clip_low"], hp["clip_high"], None)
    return _Terms(values=-objective, clipped=clipped, ratio=s.detach(), seq_clipped=clipped)


def _gspo_token_partials(x: _Batch, hp: Mapping) -> list[Tensor]:
    rows = [x.log_ratio.detach().sum(-1)]
    if not x.seq_adv:  # per-sequence counts of positive / negative token advantages (metrics)
        rows += [(x.adv > 0).sum(-1, dtype=x.logp.dtype), (x.adv < 0).sum(-1, dtype=x.logp.dtype)]
    return rows


def _gspo_token_terms(x: _Batch, hp: Mapping, lengths: Tensor, reduced: list[Tensor]) -> _Terms:
    s = torch.exp(_seq_mean_log(reduced[0], lengths))  # sg[s_i]: built from detached sums
    # s_it = sg[s_i]·exp(l_it - sg[l_it]); exp(u - sg[u]) has value 1 and derivative 1, and so has
    # 1 + u - sg[u]: the same value and gradient, without an exp over [B, T].
    s_bt = s[:, None] * (1.0 + (x.logp - x.logp.detach()))
    lo, hi = hp["clip_low"], hp["clip_high"]
    objective, clipped = _clipped_surrogate(s_bt, x.adv_bt, lo, hi, None)
    with torch.no_grad():
        if x.seq_adv:
            seq_clipped = ((x.adv > 0) & (s > 1.0 + hi)) | ((x.adv < 0) & (s < 1.0 - lo))
        else:
            n_pos, n_neg = reduced[1], reduced[2]
            seq_clipped = ((n_pos > 0) & (s > 1.0 + hi)) | ((n_neg > 0) & (s < 1.0 - lo))
    return _Terms(values=-objective, clipped=clipped, ratio=s, seq_clipped=seq_clipped)


def _ppo_terms(x: _Batch, hp: Mapping, lengths: Tensor, reduced: list[Tensor]) -> _Terms:
    r = _exp_ratio(x.log_ratio)
    objective, clipped = _clipped_surrogate(
        r, x.adv_bt, hp["clip_low"], hp["clip_high"], hp["clip_c"]
    )
    return _Terms(values=-objective, clipped=clipped, ratio=r.detach())


def sapo_gate(ratio: Tensor, tau: Tensor | float) -> Tensor:
    """SAPO's soft gate f(r) = sigmoid(tau·(r - 1))·4/tau: f(1) = 2/tau, f'(1) = 1."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def _sapo_terms(x: _Batch, hp: Mapping, lengths: Tensor, reduced: list[Tensor]) -> _Terms:
    r = _exp_ratio(x.log_ratio)
    tau = torch.where(x.adv_bt > 0, r.new_tensor(hp["tau_pos"]), r.new_tensor(hp["tau_neg"]))
    values = -sapo_gate(r, tau) * x.adv_bt
    clipped = torch.zeros((), dtype=torch.bool, device=r.device).expand(r.shape)  # no hard clip
    return _Terms(values=values, clipped=clipped, ratio=r.detach())


def _cispo_terms(x: _Batch, hp: Mapping, lengths: Tensor, reduced: list[Tensor]) -> _Terms:
    r = _exp_ratio(x.log_ratio.detach())
    weight = r.clamp(max=1.0 + hp["clip_high"])  # sg[min(r, 1 + clip_high)]; no lower clip
    values = -weight * x.adv_bt * x.logp
    return _Terms(values=values, clipped=r > 1.0 + hp["clip_high"], ratio=r)


def _gmpo_partials(x: _Batch, hp: Mapping) -> list[Tensor]:
    # log r_it clipped in the direction of sign(A_i): min(log r, clip_high) where A > 0 (the
    # log of min(r·A, clip(r)·A)/A), max(log r, -clip_low) where A < 0; unclipped where A = 0.
    lr, sign = x.log_ratio, x.adv[:, None]
    upper, lower = lr.clamp(max=hp["clip_high"]), lr.clamp(min=-hp["clip_low"])
    clipped_lr = torch.where(sign > 0, upper, torch.where(sign < 0, lower, lr))
    with torch.no_grad():
        clipped = ((sign > 0) & (lr > hp["clip_high"])) | ((sign < 0) & (lr < -hp["clip_low"]))
        clipped &= x.mask
    x.cache["clipped"] = clipped
    return [clipped_lr.sum(-1), clipped.sum(-1, dtype=x.logp.dtype)]


def _gmpo_terms(x: _Batch, hp: Mapping, lengths: Tensor, reduced: list[Tensor]) -> _Terms:
    clipped_lr_sum, n_clipped = reduced
    g = torch.exp(_seq_mean_log(clipped_lr_sum, lengths))  # clipped geometric mean of r_it
    return _Terms(
        values=-x.adv * g, clipped=x.cache["clipped"], ratio=g.detach(), seq_clipped=n_clipped > 0
    )


# --------------------------------------------------------------------------------------------
# Registry


_HPARAM_RULES: Mapping[str, tuple[float, bool]] = {
    # name: (lower bound, strict)
    "clip_low": (0.0, False),
    "clip_high": (0.0, False),
    "clip_c": (1.0, True),
    "tau_pos": (0.0, True),
    "tau_neg": (0.0, True),
    "max_response_length": (0.0, True),
}
_OPTIONAL_HPARAMS = frozenset({"clip_c"})  # None disables

ClipScale = Literal["sequence", "token"]
CLIP_SCALE_BOUNDARY = 0.01
"""clip_low / clip_high below this are at sequence scale, at or above it at token scale."""
CLIP_SCALE_PRACTICE: Mapping[str, str] = MappingProxyType(
    {
        "sequence": "the GSPO paper uses 3e-4 / 4e-4 (arXiv 2507.18071)",
        "token": "PPO and GRPO use 0.2, DAPO 0.2 / 0.28, GMPO 0.4 in log space, CISPO 4.0",
    }
)
_CLIP_SCALE_MEANING: Mapping[str, str] = MappingProxyType(
    {
        "sequence": "clips a sequence-level ratio, the geometric mean of the sequence's token "
        "ratios, which stays within about 1e-3 of 1 where token ratios spread by about 0.1: a "
        "clip this wide never clips",
        "token": "clips each token's ratio (or log-ratio): a clip this narrow clips nearly every "
        "token",
    }
)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss in :data:`POLICY_LOSSES`.

    Attributes:
        name: the config name.
        aggregation: how per-item terms sum into ``loss_sum``: ``"sequence"`` (one term per
            sequence, times seq_share), ``"seq_mean"`` (per-token terms, Σ_t / |y_i| per
            sequence), ``"seq_constant"`` (per-token terms, Σ_t / max_response_length per
            sequence), ``"token"`` (per-token terms, summed).
        defaults: accepted hyperparameters and their defaults (None: required, or disabled for
            ``clip_c``).
        sequence_advantages: advantages must be [B] (one per sequence).
        ratio_level: ``"sequence"`` or ``"token"``: which ratio the ``ratio_*`` metrics describe.
        advantage_estimator: the key of the paper's estimator in ``ADVANTAGE_ESTIMATORS``.
        clip_scale: what ``clip_low`` / ``clip_high`` bound: ``"sequence"``, a sequence-level
            ratio (GSPO's s_i, GSPO-token's sg[s_i]); ``"token"``, a token ratio (PPO, GRPO,
            DAPO, Dr.GRPO, CISPO) or a token log-ratio (GMPO, clipped in log space before the
            geometric mean); None, no hard clip (SAPO). See :func:`clip_scale_problem`.
    """

    name: str
    aggregation: Aggregation
    defaults: Mapping[str, float | None]
    sequence_advantages: bool
    ratio_level: Literal["sequence", "token"]
    advantage_estimator: str
    clip_scale: ClipScale | None
    partials: Callable[[_Batch, Mapping], list[Tensor]] = field(repr=False)
    terms: Callable[[_Batch, Mapping, Tensor, list[Tensor]], _Terms] = field(repr=False)

    @property
    def denominator(self) -> Denominator:
        """``"tokens"`` for token-level aggregation, else ``"sequences"``."""
        return "tokens" if self.aggregation == "token" else "sequences"

    def resolve_hparams(self, hparams: Mapping[str, object]) -> dict[str, float | None]:
        """Defaults overlaid with ``hparams`` (None keeps the default), each value checked."""
        unknown = sorted(set(hparams) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"{unknown[0]} is not a hyperparameter of loss {self.name!r}; "
                f"it accepts {sorted(self.defaults)}"
            )
        resolved: dict[str, float | None] = {}
        for key, default in self.defaults.items():
            value = hparams.get(key)
            value = default if value is None else value
            if value is None:
                if key in _OPTIONAL_HPARAMS:
                    resolved[key] = None
                    continue
                raise ValueError(f"{key} is required by loss {self.name!r}")
            minimum, strict = _HPARAM_RULES[key]
            resolved[key] = require_number(
                key, value, minimum=minimum, strict=strict, owner=self.name
            )
        return resolved


def _spec(
    name: str,
    aggregation: Aggregation,
    defaults: dict[str, float | None],
    terms: Callable[[_Batch, Mapping, Tensor, list[Tensor]], _Terms],
    partials: Callable[[_Batch, Mapping], list[Tensor]] = _no_partials,
    *,
    sequence_advantages: bool = False,
    ratio_level: Literal["sequence", "token"] = "token",
    advantage_estimator: str = "group_mean_std",
    clip_scale: ClipScale | None = "token",
) -> PolicyLossSpec:
    return PolicyLossSpec(
        name=name,
        aggregation=aggregation,
        defaults=MappingProxyType(defaults),
        sequence_advantages=sequence_advantages,
        ratio_level=ratio_level,
        advantage_estimator=advantage_estimator,
        clip_scale=clip_scale,
        partials=partials,
        terms=terms,
    )


_PPO = {"clip_low": 0.2, "clip_high": 0.2, "clip_c": None}
_SEQ: dict = {"sequence_advantages": True, "ratio_level": "sequence", "clip_scale": "sequence"}

POLICY_LOSSES: Mapping[str, PolicyLossSpec] = MappingProxyType(
    {
        "gspo": _spec(
            "gspo", "sequence", {"clip_low": 3e-4, "clip_high": 4e-4}, _gspo_terms,
            _gspo_partials, **_SEQ,
        ),
        "gspo_token": _spec(
            "gspo_token", "seq_mean", {"clip_low": 3e-4, "clip_high": 4e-4}, _gspo_token_terms,
            _gspo_token_partials, ratio_level="sequence", clip_scale="sequence",
        ),
        "ppo": _spec("ppo", "token", dict(_PPO), _ppo_terms),
        "grpo": _spec("grpo", "seq_mean", dict(_PPO), _ppo_terms),
        "dapo": _spec("dapo", "token", _PPO | {"clip_high": 0.28}, _ppo_terms),
        "dr_grpo": _spec(
            "dr_grpo", "seq_constant", _PPO | {"max_response_length": None}, _ppo_terms,
            advantage_estimator="group_mean",
        ),
        "sapo": _spec(
            "sapo", "seq_mean", {"tau_pos": 1.0, "tau_neg": 1.05}, _sapo_terms, clip_scale=None,
        ),
        "cispo": _spec("cispo", "token", {"clip_high": 4.0}, _cispo_terms),
        # GMPO's ratio is sequence-level, but its clip bounds each token's log-ratio.
        "gmpo": _spec(
            "gmpo", "sequence", {"clip_low": 0.4, "clip_high": 0.4}, _gmpo_terms,
            _gmpo_partials, **(_SEQ | {"clip_scale": "token"}),
        ),
    }
)  # fmt: skip
"""Loss name -> :class:`PolicyLossSpec`."""


def get_policy_loss(name: str) -> PolicyLossSpec:
    """The spec registered under ``name``; ValueError listing the known names otherwise."""
    spec = POLICY_LOSSES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"name must be one of {sorted(POLICY_LOSSES)}, got {name!r}")
    return spec


def clip_scale_problem(name: str, hparams: Mapping[str, object]) -> tuple[str, str] | None:
    """(the hyper-parameter, why) when loss ``name``'s clip range is at the other scale than
    the ratio it clips (``PolicyLossSpec.clip_scale``), else None.

    A clip of a sequence-level ratio at or above ``CLIP_SCALE_BOUNDARY`` (PPO's 0.2 for GSPO)
    never clips: a sequence ratio is the geometric mean of the token ratios and stays within
    ~1e-3 of 1 where token ratios spread by ~0.1. A token-level clip below it clips nearly
    every token. ``hparams`` as the config gives them (defaults fill the rest).
    """
    spec = get_policy_loss(name)
    if spec.clip_scale is None:
        return None
    resolved = spec.resolve_hparams(hparams)
    for key in ("clip_low", "clip_high"):
        value = resolved.get(key)
        if value is None:
            continue
        wide = value >= CLIP_SCALE_BOUNDARY
        if wide == (spec.clip_scale == "sequence"):
            scale = "token" if wide else "sequence"
            return key, (
                f"{value:g} is a {scale}-scale clip, but {name} "
                f"{_CLIP_SCALE_MEANING[spec.clip_scale]} ({CLIP_SCALE_PRACTICE[spec.clip_scale]})"
            )
    return None


def denominator_count(name: str, response_mask: Tensor) -> Tensor:
    """This batch's share of D before any forward pass: sequences with >= 1 response token, or
    response tokens, per ``POLICY_LOSSES[name].denominator`` (whole sequences, no CP split)."""
    mask = require_tensor("response_mask", response_mask) != 0
    if get_policy_loss(name).denominator == "tokens":
        return mask.sum()
    return mask.any(dim=-1).sum()


# --------------------------------------------------------------------------------------------
# Entry points


def _aggregate(
    aggregation: Aggregation,
    values: Tensor,
    mask: Tensor,
    lengths: Tensor,
    weight_b: Tensor,
    hp: Mapping,
) -> Tensor:
    """Σ of this share's per-item terms. ``values``: [B] for "sequence", else [B, T]."""
    if aggregation == "sequence":
        return torch.where(weight_b > 0, values * weight_b, 0.0).sum()
    per_seq = torch.where(mask, values, 0.0).sum(-1)
    if aggregation == "seq_mean":
        return (per_seq / lengths.clamp(min=1.0)).sum()
    if aggregation == "seq_constant":
        return per_seq.sum() / hp["max_response_length"]
    return per_seq.sum()


def _prepare(
    spec: PolicyLossSpec,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    seq_share: Tensor | None,
    is_weights: Tensor | None,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    check_values: bool,
) -> tuple[_Batch, Tensor, Tensor | None, Tensor | None, Tensor | None, torch.dtype]:
    logprobs = require_tensor("logprobs", logprobs, floating=True)
    if logprobs.dim() != 2 or logprobs.shape[0] == 0 or logprobs.shape[1] == 0:
        raise ValueError(f"logprobs must be a non-empty [B, T] tensor, got {shape(logprobs)}")
    bt = shape(logprobs)
    b = bt[:1]
    old_logprobs = require_tensor("old_logprobs", old_logprobs, floating=True)
    require_shape("old_logprobs", old_logprobs, bt, "the shape of logprobs")
    response_mask = require_tensor("response_mask", response_mask)
    require_shape("response_mask", response_mask, bt, "the shape of logprobs")
    advantages = require_tensor("advantages", advantages)
    if spec.sequence_advantages:
        require_shape("advantages", advantages, b, f"one per sequence for {spec.name!r}")
    elif shape(advantages) not in (b, bt):
        raise ValueError(f"advantages must have shape {b} or {bt}, got {shape(advantages)}")
    if seq_share is not None:
        require_shape("seq_share", require_tensor("seq_share", seq_share), b, "one per sequence")
    if is_weights is not None:
        is_weights = require_tensor("is_weights", is_weights)
        if spec.aggregation == "sequence":
            require_shape("is_weights", is_weights, b, f"one per sequence for {spec.name!r}")
        elif shape(is_weights) not in (b, bt):
            raise ValueError(f"is_weights must have shape {b} or {bt}, got {shape(is_weights)}")
    if ref_logprobs is not None:
        ref_logprobs = require_tensor("ref_logprobs", ref_logprobs, floating=True)
        require_shape("ref_logprobs", ref_logprobs, bt, "the shape of logprobs")
    if entropy is not None:
        entropy = require_tensor("entropy", entropy, floating=True)
        require_shape("entropy", entropy, bt, "the shape of logprobs")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    if check_values:
        flags = {}
        if response_mask.dtype != torch.bool:
            flags["response_mask must hold only 0 and 1"] = (
                (response_mask != 0) & (response_mask != 1)
            ).any()
        named = {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "ref_logprobs": ref_logprobs,
            "entropy": entropy,
        }
        for name, t in named.items():
            if t is not None:
                flags[f"{name} must be finite on response tokens"] = nonfinite_on(t, mask)
        for name, t in {"advantages": advantages, "is_weights": is_weights}.items():
            if t is not None:
                on = mask if t.dim() == 2 else mask.any(-1)
                flags[f"{name} must be finite on response tokens"] = nonfinite_on(t, on)
        if is_weights is not None:
            flags["is_weights must be >= 0"] = (is_weights < 0).any()
        raise_if_flagged(flags)

    # Positions outside the mask are replaced by 0 (not multiplied by it), so padding values —
    # even NaN/inf — reach neither the loss nor the gradient.
    logp = torch.where(mask, logprobs.to(dtype), 0.0)
    old = torch.where(mask, old_logprobs.detach().to(dtype), 0.0)
    adv = advantages.detach().to(dtype)
    if adv.dim() == 2:
        adv = torch.where(mask, adv, 0.0)
        adv_bt = adv
    else:
        # Not zeroed by the local mask: under CP a rank may hold no token of a sequence whose
        # sequence-level term it still shares. Non-finite values can only sit on rows without
        # response token here (checked above), which never count.
        adv = torch.where(torch.isfinite(adv), adv, 0.0)
        adv_bt = adv[:, None].expand(bt)
    if is_weights is not None:
        is_weights = is_weights.detach().to(dtype)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs.detach().to(dtype), 0.0)
    if entropy is not None:
        entropy = torch.where(mask, entropy.to(dtype), 0.0)  # differentiable: a bonus term
    x = _Batch(logp=logp, log_ratio=logp - old, mask=mask, adv=adv, adv_bt=adv_bt)
    return x, mask, is_weights, ref_logprobs, entropy, dtype


def policy_loss_terms(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    seq_sum: SeqSum | None = None,
    seq_share: Tensor | None = None,
    is_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_buckets: Mapping[str, tuple[Tensor, Sequence[str]]] | None = None,
    check_values: bool = True,
    **hparams: float | None,
) -> LossTerms:
    """This micro-batch's / rank's share of loss ``name`` (see the module docstring).

    Args:
        name: a key of :data:`POLICY_LOSSES`.
        logprobs: [B, T] float, log pi_theta of the response tokens (differentiable).
        old_logprobs: [B, T], log pi_old (treated as constant).
        advantages: [B] or [B, T] ([B] only for sequence-level losses ``gspo``, ``gmpo``).
        response_mask: [B, T] bool or 0/1; rows without response token are legal.
        seq_sum: called once with a [K, B] tensor of stacked per-sequence partial sums; must
            return the [K, B] sums over all ranks holding parts of each sequence, with an
            autograd-correct backward (the gradient of each output row reaches every rank's
            partial). Default: identity (each rank holds whole sequences).
        seq_share: [B] float, this rank's share of each sequence (shares of one sequence sum to 1
            over the ranks). Default: ones.
        is_weights: detached train/rollout mismatch weights multiplying each policy term: [B] or
            [B, T] for token-level terms, [B] for ``gspo``/``gmpo`` (see ``mismatch.py``).
        ref_logprobs: [B, T] log pi_ref, needed when ``kl_coef > 0``.
        kl_coef: coefficient of a KL(pi || pi_ref) penalty aggregated like the loss's own terms
            (per-sequence token mean for sequence-level losses).
        kl_estimator: a key of ``KL_ESTIMATORS``.
        entropy: [B, T] the policy's entropy per token (differentiable), needed when
            ``entropy_coef > 0``.
        entropy_coef: weight of an entropy bonus, subtracted from the loss and aggregated like
            the KL penalty.
        token_buckets: group name -> (bucket index per token [B, T] or per sequence [B],
            integer; the buckets' labels): the clip fraction of each bucket as
            ``clip_fraction_<group>_<label>`` (``metrics.clip_buckets`` builds them: version lag
            and response length).
        check_values: check that log-probs/advantages/weights are finite on response tokens and
            the mask is 0/1 (one host sync); shapes are always checked.
        **hparams: the loss's hyperparameters (``POLICY_LOSSES[name].defaults``); None keeps the
            default.

    Returns:
        :class:`LossTerms`. Global loss = Σ loss_sum / Σ denominator over micro-batches and ranks.
    """
    spec = get_policy_loss(name)
    hp = spec.resolve_hparams(hparams)
    kl_coef = require_number("kl_coef", kl_coef, minimum=0.0)
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_estimator must be one of {sorted(KL_ESTIMATORS)}, got {kl_estimator!r}"
        )
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_coef > 0")
    entropy_coef = require_number("entropy_coef", entropy_coef, minimum=0.0)
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy is required when entropy_coef > 0")
    x, mask, weights, ref, ent, dtype = _prepare(
        spec, logprobs, old_logprobs, advantages, response_mask, seq_share, is_weights,
        ref_logprobs, entropy, check_values,
    )  # fmt: skip
    if seq_share is None:
        share = torch.ones(mask.shape[0], dtype=dtype, device=mask.device)
    else:
        share = seq_share.detach().to(dtype)

    # One reduction of every per-sequence partial sum, before any nonlinearity.
    local_lengths = mask.sum(-1, dtype=dtype)
    stacked = torch.stack([local_lengths, *spec.partials(x, hp)])
    reduced = stacked if seq_sum is None else seq_sum(stacked)
    if not isinstance(reduced, Tensor) or reduced.shape != stacked.shape:
        raise ValueError(f"seq_sum must return a tensor of shape {list(stacked.shape)}")
    lengths, *rest = reduced.unbind(0)
    valid = lengths > 0.5
    seq_weight = torch.where(valid, share, 0.0)  # N share of each sequence

    out = spec.terms(x, hp, lengths, rest)
    values = out.values
    if weights is not None:
        values = values * (weights if weights.dim() == 2 or values.dim() == 1 else weights[:, None])
    loss_sum = _aggregate(spec.aggregation, values, mask, lengths, seq_weight, hp)

    # Per-token regularisers: a per-sequence token mean under a sequence-level loss.
    token_agg = "seq_mean" if spec.aggregation == "sequence" else spec.aggregation
    kl_bt = None
    if ref is not None:
        kl_bt = KL_ESTIMATORS[kl_estimator](ref - x.logp)
        if kl_coef > 0:
            loss_sum = loss_sum + kl_coef * _aggregate(
                token_agg, kl_bt, mask, lengths, seq_weight, hp
            )
    if ent is not None and entropy_coef > 0:
        loss_sum = loss_sum - entropy_coef * _aggregate(
            token_agg, ent, mask, lengths, seq_weight, hp
        )

    num_tokens = local_lengths.sum()
    num_seqs = seq_weight.sum()
    denominator = num_tokens if spec.denominator == "tokens" else num_seqs
    metric_sums = _metric_sums(spec, x, out, mask, valid, seq_weight, num_tokens, num_seqs, kl_bt)
    if token_buckets:
        metric_sums.update(_bucket_clip_sums(out.clipped, mask, token_buckets, num_tokens.dtype))
    metric_sums["loss/sum"] = loss_sum.detach()
    metric_sums["loss/count"] = denominator.detach()
    return LossTerms(loss_sum=loss_sum, denominator=denominator.detach(), metric_sums=metric_sums)


@torch.no_grad()
def _metric_sums(
    spec: PolicyLossSpec,
    x: _Batch,
    out: _Terms,
    mask: Tensor,
    valid: Tensor,
    seq_weight: Tensor,
    num_tokens: Tensor,
    num_seqs: Tensor,
    kl_bt: Tensor | None,
) -> dict[str, Tensor]:
    inf = torch.tensor(float("inf"), dtype=num_tokens.dtype, device=num_tokens.device)
    m: dict[str, Tensor] = {"num_tokens/sum": num_tokens, "num_sequences/sum": num_seqs}

    def mean_min_max(key: str, values: Tensor, on: Tensor, weight: Tensor, count: Tensor) -> None:
        m[f"{key}_mean/sum"] = torch.where(on, values * weight, 0.0).sum()
        m[f"{key}_mean/count"] = count
        m[f"{key}_max/max"] = torch.where(on, values, -inf).max()
        m[f"{key}_min/min"] = torch.where(on, values, inf).min()

    if out.clipped.dim() == 1:  # whole sequences clipped (gspo): Σ_i clipped_i · local |y_i|
        n_clipped = (out.clipped * mask.sum(-1)).sum()
    else:
        n_clipped = (out.clipped & mask).sum()
    m["clip_fraction/sum"] = n_clipped.to(num_tokens.dtype)
    m["clip_fraction/count"] = num_tokens
    if out.seq_clipped is not None:
        m["seq_clip_fraction/sum"] = (out.seq_clipped * seq_weight).sum()
        m["seq_clip_fraction/count"] = num_seqs
    if out.ratio.dim() == 1:
        mean_min_max("ratio", out.ratio, valid, seq_weight, num_seqs)
    else:
        mean_min_max("ratio", out.ratio, mask, 1.0, num_tokens)
    # KL(pi_old || pi) on samples of pi_old, k3 with r = pi / pi_old.
    lr = x.log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    m["approx_kl/sum"] = torch.where(mask, torch.expm1(lr) - lr, 0.0).sum()
    m["approx_kl/count"] = num_tokens
    if x.seq_adv:
        mean_min_max("advantage", x.adv, valid, seq_weight, num_seqs)
    else:
        mean_min_max("advantage", x.adv, mask, 1.0, num_tokens)
    if kl_bt is not None:
        m["kl_ref/sum"] = torch.where(mask, kl_bt.detach(), 0.0).sum()
        m["kl_ref/count"] = num_tokens
    return m


@torch.no_grad()
def _bucket_clip_sums(
    clipped: Tensor,
    mask: Tensor,
    buckets: Mapping[str, tuple[Tensor, Sequence[str]]],
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """Clipped tokens / tokens of every bucket (a clipped sequence counts all its tokens)."""
    clipped_bt = (clipped[:, None] if clipped.dim() == 1 else clipped) & mask
    out = {}
    for group, (index, labels) in buckets.items():
        index = require_tensor(f"token_buckets[{group!r}]", index)
        if shape(index) == shape(mask)[:1]:
            index = index[:, None]
        elif shape(index) != shape(mask):
            raise ValueError(
                f"token_buckets[{group!r}] must have shape {shape(mask)[:1]} or {shape(mask)}, "
                f"got {shape(index)}"
            )
        index = index.to(mask.device).expand(mask.shape)
        for k, label in enumerate(labels):
            chosen = mask & (index == k)
            out[f"clip_fraction_{group}_{label}/sum"] = (clipped_bt & chosen).sum().to(dtype)
            out[f"clip_fraction_{group}_{label}/count"] = chosen.sum().to(dtype)
    return out


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **kwargs: object,
) -> tuple[Tensor, dict[str, float]]:
    """Loss ``name`` treating the given batch as the whole global batch.

    Same arguments as :func:`policy_loss_terms` except ``seq_sum``/``seq_share`` (a single batch
    holds whole sequences). Returns the scalar loss to minimize (differentiable w.r.t.
    ``logprobs``; 0 with an intact graph if the batch has no response token) and float metrics:
    ``loss``, ``clip_fraction``, ``seq_clip_fraction`` (sequence-level losses), ``ratio_mean``,
    ``ratio_min``, ``ratio_max``, ``approx_kl``, ``advantage_mean/min/max``, ``kl_ref`` (with
    ``ref_logprobs``), ``num_tokens``, ``num_sequences``.
    """
    for key in ("seq_sum", "seq_share"):
        if key in kwargs:
            raise ValueError(f"{key} is for policy_loss_terms; policy_loss sees whole sequences")
    terms = policy_loss_terms(name, logprobs, old_logprobs, advantages, response_mask, **kwargs)
    return terms.loss(), finalize_metrics(terms.metric_sums, omit_empty=(CLIP_BUCKET_PREFIX,))
