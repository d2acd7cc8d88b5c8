"""Per-GPU memory plan of a training run: parameters, gradients, optimizer state, activations and
the rollout engine's share, for each pipeline stage; whether the worst rank fits.

No megatron import: it runs on a login node in a second. Parameter counts are exact for the
megatron-core 0.19.2 Qwen3(-MoE) model that `gspo_megatron.megatron.model` builds (checked against
megatron's own modules for every preset by tests/planner). Everything else is an estimate whose
assumptions are stated where it is computed; `ASSUMPTIONS` is printed by tools/plan_memory.py.

Ranks: megatron orders ranks tp-cp-ep-dp-pp, so pipeline stage s holds global ranks
[s*world/pp, (s+1)*world/pp). Within a stage every rank holds the same number of parameters
(vocabulary rows are padded to a multiple of tp; experts divide evenly), so one row per stage
describes every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gspo_megatron.rollout.backends import RolloutShare, memory_share
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings, resolve_targets
from gspo_megatron.spec.model_config import ModelConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

ASSUMPTIONS = """\
Assumptions of the estimate (parameters are exact; the rest is an estimate):
- Weights in model.params_dtype; gradients in float32 (megatron DDP, grad_reduce_in_fp32=True);
  Adam state = float32 exp_avg + exp_avg_sq, plus a float32 master copy when the weights are
  bf16/fp16. The distributed optimizer shards that state over the data-parallel ranks of each
  parameter: dp*cp ranks for dense parameters, the expert-data-parallel ranks (edp) for experts.
  Gradient buffers are never sharded (megatron keeps the full buffer on every rank).
- Activations per layer and micro-batch, in model.params_dtype, for T = micro-batch tokens / cp
  tokens per rank (sequence parallelism splits the norm/residual activations by tp): saved inputs
  of both RMSNorms and of the QKV and MLP projections, Q/K norm inputs, Q/K/V and the attention
  output (flash attention: no T^2 term), router logits and probabilities in float32, and for the
  routed token copies (top-k) the expert input, gate/up output, SwiGLU output and expert output
  (routing assumed balanced, times --moe-imbalance). Context parallelism adds the gathered K/V.
- Full recomputation (engine.recompute_activations) keeps only each layer's input per
  micro-batch plus one layer's activations while it is recomputed.
- Pipeline: a stage holds the activations of its in-flight micro-batches, megatron's warm-up
  count + 1: pp - stage for 1F1B, 2*(pp - stage - 1) + (vpp - 1)*pp + 1 model chunks when
  interleaved, capped by the micro-batches of one optimizer step. The last stage adds the logits
  and their gradient ([T, vocab/tp] each) and 0.25 GiB of float32 log-prob chunks.
- Micro-batch tokens = min(engine.max_tokens_per_microbatch, the tokens one DP rank trains on
  per optimizer step, at engine.max_sequence_length per response).
- Rollout, colocated: the embedded engine adds a KV cache of rollout.max_batch_tokens slots for
  this stage's layers plus one layer's prefill activations while generating, and the K/V of up
  to rollout.prefix_cache_tokens tokens kept between calls (counted with or without an
  environment, which alone keeps them; in rollout.mode=sync both freed before training; the
  generator process of one_step_off / async keeps its context until its next weight update).
  With LoRA on a layout that does not split the model (tp = ep = etp = pp = 1), sync mode's
  torch decoder also holds a merged copy of every adapted weight while a batch generates.
  Colocated SGLang servers hold mem_fraction_static of the GPU while generating; with
  offload_after_generate they keep ~2 GiB (CUDA context, graphs' pools) while training,
  without it their whole fraction. Servers on other GPUs (disaggregated) cost the trainer nothing.
- While generating, trainer.offload_during_rollout frees: optimizer = the optimizer state; all =
  also the gradient buffers, the KL reference's weights, and the policy's weights unless the
  embedded engine generates with them. The rest of the training state stays resident.
- Fixed overhead per GPU (CUDA context, NCCL communicators, library workspaces): 3 GiB, plus 10%
  of the activations for allocator fragmentation.
"""


class PlanError(ValueError):
    """Inputs the planner cannot plan; the message names the setting."""


# -- parameters (exact) -------------------------------------------------------------------------


@dataclass(frozen=True)
class StageParams:
    """Parameters on one rank of a pipeline stage (all of its virtual chunks)."""

    stage: int
    layers: int
    dense: int  # attention, norms, router, embedding/output: gradients reduced over dp*cp
    expert: int  # routed experts: gradients reduced over edp
    # LoRA adapters (lora.rank): the only trained parameters when there are any
    adapter_dense: int = 0
    adapter_expert: int = 0
    saved_dense: int = 0  # of `dense`: whole weights trained beside them (lora.modules_to_save)

    @property
    def total(self) -> int:
        return self.dense + self.expert + self.adapter_dense + self.adapter_expert

    @property
    def trained(self) -> tuple[int, int]:
        """(dense, expert) parameters with gradients and optimizer state."""
        if self.adapter_dense or self.adapter_expert:
            return self.adapter_dense + self.saved_dense, self.adapter_expert
        return self.dense, self.expert


def layer_params(model: ModelConfig, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one decoder layer on one rank (megatron's local spec)."""
    h, d = model.hidden_size, model.head_dim
    nq, nkv = model.num_attention_heads, model.num_key_value_heads
    qkv_out = (nq + 2 * nkv) * d
    dense = h  # input_layernorm
    dense += qkv_out // tp * h + (qkv_out // tp if model.attention_bias else 0)  # linear_qkv
    dense += 2 * d  # q_layernorm, k_layernorm (per head dim, replicated)
    dense += h * (nq * d // tp)  # linear_proj
    dense += h  # pre_mlp_layernorm
    if not model.is_moe:
        ffn = model.intermediate_size
        return dense + 2 * ffn // tp * h + h * (ffn // tp), 0
    dense += model.num_experts * h  # router (replicated over tp)
    ffn = model.moe_intermediate_size // etp
    expert = model.num_experts // ep * (2 * ffn * h + h * ffn)
    return dense, expert


def lora_layer_params(
    model: ModelConfig, lora: LoRASettings, tp: int = 1, ep: int = 1, etp: int = 1
) -> tuple[int, int]:
    """(dense, expert) LoRA adapter parameters of one decoder layer on one rank
    (as the megatron package shards them: a column-parallel layer's B and a row-parallel layer's
    A split like the weight, the other factor whole)."""
    r, h, d = lora.rank, model.hidden_size, model.head_dim
    targets = resolve_targets(lora.targets, model.is_moe)
    nq, nkv = model.num_attention_heads, model.num_key_value_heads

    def column(inputs: int, outputs: int, split: int) -> int:
        return r * inputs + outputs // split * r

    def row(inputs: int, outputs: int, split: int) -> int:
        return r * (inputs // split) + outputs * r

    dense = expert = 0
    if "attention.linear_qkv" in targets:
        dense += column(h, (nq + 2 * nkv) * d, tp)
    if "attention.linear_proj" in targets:
        dense += row(nq * d, h, tp)
    if "mlp.linear_fc1" in targets:
        dense += column(h, 2 * model.intermediate_size, tp)
    if "mlp.linear_fc2" in targets:
        dense += row(model.intermediate_size, h, tp)
    per_expert = 0
    if "experts.linear_fc1" in targets:
        per_expert += column(h, 2 * model.moe_intermediate_size, etp)
    if "experts.linear_fc2" in targets:
        per_expert += row(model.moe_intermediate_size, h, etp)
    if per_expert:
        expert = model.num_experts // ep * per_expert
    return dense, expert


def lora_adapted_weight_params(model: ModelConfig, lora: LoRASettings) -> int:
    """Parameters of one decoder layer's weights that `lora`'s adapters sit on, unsplit."""
    h, d = model.hidden_size, model.head_dim
    targets = resolve_targets(lora.targets, model.is_moe)
    sizes = {
        "attention.linear_qkv": (model.num_attention_heads + 2 * model.num_key_value_heads) * d * h,
        "attention.linear_proj": h * model.num_attention_heads * d,
        "mlp.linear_fc1": 2 * model.intermediate_size * h,
        "mlp.linear_fc2": h * model.intermediate_size,
        "experts.linear_fc1": model.num_experts * 2 * model.moe_intermediate_size * h,
        "experts.linear_fc2": model.num_experts * h * model.moe_intermediate_size,
    }
    return sum(size for name, size in sizes.items() if name in targets)


def stage_params(
    model: ModelConfig, layout: ParallelLayout, stage: int, lora: LoRASettings | None = None
) -> StageParams:
    """Exact parameter count of every rank of pipeline stage `stage` (with `lora`'s adapters
    when it is enabled)."""
    _check_divisible(model, layout)
    layers = model.num_hidden_layers // layout.pp
    dense, expert = layer_params(model, layout.tp, layout.ep, layout.etp)
    dense, expert = dense * layers, expert * layers
    adapter_dense = adapter_expert = 0
    if lora is not None and lora.enabled:
        adapter_dense, adapter_expert = lora_layer_params(
            model, lora, layout.tp, layout.ep, layout.etp
        )
        adapter_dense, adapter_expert = adapter_dense * layers, adapter_expert * layers
    vocab_rows = model.padded_vocab_size(layout.tp) // layout.tp * model.hidden_size
    saved = set(lora.modules_to_save) if lora is not None and lora.enabled else set()
    saved_dense = 0
    if stage == 0:
        dense += vocab_rows  # embedding.word_embeddings
        saved_dense += vocab_rows if "embedding" in saved else 0
    if stage == layout.pp - 1:
        dense += model.hidden_size  # decoder.final_layernorm
        saved_dense += model.hidden_size if "final_norm" in saved else 0
        if not model.tie_word_embeddings or layout.pp > 1:
            # Untied output layer; with tied embeddings and pp > 1 megatron keeps a copy of the
            # embedding on the last stage (kept equal by an all-reduce of its gradient).
            dense += vocab_rows
            saved_dense += vocab_rows if "output_layer" in saved else 0
    return StageParams(
        stage=stage,
        layers=layers,
        dense=dense,
        expert=expert,
        adapter_dense=adapter_dense,
        adapter_expert=adapter_expert,
        saved_dense=saved_dense,
    )


def model_params(model: ModelConfig) -> int:
    """Parameters of the whole model (megatron's count on one GPU, vocabulary padded)."""
    return stage_params(model, ParallelLayout(), 0).total


def active_params(model: ModelConfig) -> int:
    """Parameters one token passes through (embedding row excluded, output layer included)."""
    dense, expert = layer_params(model)
    if model.is_moe:
        expert = expert // model.num_experts * model.num_experts_per_tok
    per_layer = dense + expert
    head = model.hidden_size + model.padded_vocab_size(1) * model.hidden_size
    return model.num_hidden_layers * per_layer + head


def _check_divisible(model: ModelConfig, layout: ParallelLayout) -> None:
    try:
        layout.check_model(
            num_layers=model.num_hidden_layers,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_key_value_heads,
            num_experts=model.num_experts if model.is_moe else None,
        )
    except ValueError as err:
        raise PlanError(str(err)) from err
    if model.is_moe and model.moe_intermediate_size % layout.etp:
        raise PlanError(
            f"parallel.etp={layout.etp} must divide the model's "
            f"moe_intermediate_size={model.moe_intermediate_size}"
        )
    if not model.is_moe and model.intermediate_size % layout.tp:
        raise PlanError(
            f"parallel.tp={layout.tp} must divide the model's "
            f"intermediate_size={model.intermediate_size}"
        )


# -- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanSettings:
    micro_batch_tokens: int
    microbatches: int = 1 << 20  # per optimizer step and DP rank; caps the in-flight count
    distributed_optimizer: bool = True
    recompute: bool = False
    gpu_memory_gib: float = 80.0
    rollout: RolloutShare = field(default_factory=RolloutShare)
    overhead_gib: float = 3.0
    fragmentation: float = 0.10
    moe_imbalance: float = 1.0
    # A frozen copy of the initial policy for the KL penalty (algorithm.kl_coef > 0): weights
    # only, no gradients or optimizer state. (With LoRA the reference is the policy's own base
    # model: no copy.)
    reference_model: bool = False
    # LoRA adapters (the `lora` section): the policy's weights plus the adapters; gradients and
    # optimizer state of the adapters only.
    lora: LoRASettings | None = None
    # PPO's value model (algorithm.advantage=gae): the policy's architecture with weights,
    # gradients and optimizer state of its own, counted as the policy's (its scalar head for the
    # vocabulary projection: a slight overestimate), on critic_layout (None: the policy's); a
    # rank holds the critic's share of the critic stage it is in. It trains after the policy,
    # one minibatch at a time, so its activations reuse the policy's.
    critic_model: bool = False
    critic_layout: ParallelLayout | None = None
    # A learned reward model (reward.model_path): its own architecture, frozen (weights only)
    # on the policy's layout; it scores while rollouts are generated, so it is never offloaded.
    reward_model: ModelConfig | None = None
    offload_during_rollout: str = "none"  # none | optimizer | all (trainer.offload_during_rollout)

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1 or self.microbatches < 1:
            raise PlanError("micro-batch tokens and micro-batch count must be >= 1")
        if self.gpu_memory_gib <= 0:
            raise PlanError(f"GPU memory must be > 0 GiB, got {self.gpu_memory_gib}")
        if self.moe_imbalance < 1:
            raise PlanError(f"MoE imbalance must be >= 1, got {self.moe_imbalance}")
        if self.offload_during_rollout not in ("none", "optimizer", "all"):
            raise PlanError(
                "offload during rollout must be none, optimizer or all, got "
                f"{self.offload_during_rollout!r}"
            )


# -- activations (estimate) ------------------------------------------------------------------


def layer_activation_bytes(
    model: ModelConfig, layout: ParallelLayout, tokens: float, moe_imbalance: float = 1.0
) -> float:
    """Bytes one decoder layer keeps for backward for a micro-batch of `tokens` tokens."""
    b = DTYPE_BYTES[model.params_dtype]
    t, cp = layout.tp, layout.cp
    sp = t if layout.sequence_parallel else 1
    s = tokens / cp
    h, d = model.hidden_size, model.head_dim
    nq, nkv = model.num_attention_heads, model.num_key_value_heads
    per_token = (
        2 * h / sp  # input_layernorm input, linear_qkv input
        + (nq + nkv) * d / t  # q/k layernorm inputs
        + (nq + 2 * nkv) * d / t  # Q, K, V saved by flash attention
        + nq * d / t  # attention output (= linear_proj input)
    )
    attention = s * b * per_token + s * nq / t * 4  # + softmax log-sum-exp in float32
    if cp > 1:
        attention += (cp - 1) * s * 2 * nkv * d / t * b  # K/V gathered from the other CP ranks
    if not model.is_moe:
        ffn = model.intermediate_size
        mlp = s * b * (2 * h / sp + 3 * ffn / t)  # norm, fc1 input, gate/up, SwiGLU output
        return attention + mlp
    n = s / sp  # tokens entering the router on this rank
    routed = n * model.num_experts_per_tok * moe_imbalance
    mlp = (
        n * 2 * h * b  # pre_mlp_layernorm input and output
        + n * model.num_experts * 4 * 3  # router logits, probabilities, aux-loss scores (fp32)
        + routed * layout.etp * h * b * 2  # expert input and expert output (for the prob grad)
        + routed * 3 * model.moe_intermediate_size * b  # gate/up (2I/etp * etp) + SwiGLU
    )
    return attention + mlp


def layer_input_bytes(model: ModelConfig, layout: ParallelLayout, tokens: float) -> float:
    sp = layout.tp if layout.sequence_parallel else 1
    return tokens / layout.cp / sp * model.hidden_size * DTYPE_BYTES[model.params_dtype]


def in_flight_chunks(layout: ParallelLayout, stage: int, microbatches: int) -> int:
    """Model-chunk forward passes whose activations a stage holds at its peak (megatron 1F1B)."""
    if layout.vpp == 1:
        return min(layout.pp - stage, microbatches)
    warmup = (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp
    return min(warmup + 1, microbatches * layout.vpp)


# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """One rank of a pipeline stage; sizes in GiB."""

    stage: int
    ranks: tuple[int, int]  # first and last global rank of the stage
    params: StageParams
    weights: float
    reference: float  # the frozen KL reference's weights (0 without one)
    critic: float  # PPO's value model: weights, gradients and optimizer state (0 without one)
    critic_optimizer: float  # of which its optimizer state
    reward_model: float  # a learned reward model's weights (0 without one)
    grads: float
    optimizer: float
    activations_full: float  # without recomputation
    activations_recompute: float  # with full recomputation
    activations: float  # the one the run uses
    in_flight: int
    rollout_training: float  # rollout engine's memory while training
    rollout_generating: float  # rollout engine's memory while generating
    overhead: float
    fragmentation: float
    offloaded: float  # training state moved to host memory while generating

    @property
    def static(self) -> float:
        return (
            self.weights
            + self.reference
            + self.critic
            + self.reward_model
            + self.grads
            + self.optimizer
        )

    @property
    def training_peak(self) -> float:
        return (
            self.static
            + self.activations
            + self.fragmentation
            + self.rollout_training
            + (self.overhead)
        )

    @property
    def generation_peak(self) -> float:
        return self.static - self.offloaded + self.rollout_generating + self.overhead

    @property
    def peak(self) -> float:
        return max(self.training_peak, self.generation_peak)


@dataclass(frozen=True)
class MemoryPlan:
    model: ModelConfig
    layout: ParallelLayout
    settings: PlanSettings
    stages: tuple[RankMemory, ...]

    @property
    def worst(self) -> RankMemory:
        return max(self.stages, key=lambda r: r.peak)

    @property
    def fits(self) -> bool:
        return self.worst.peak <= self.settings.gpu_memory_gib

    @property
    def max_server_fraction(self) -> float:
        """Largest share of each GPU colocated rollout servers may hold (SGLang's
        mem_fraction_static) that the worst stage leaves room for."""
        room = min(
            self.settings.gpu_memory_gib - (r.static - r.offloaded) - r.overhead
            for r in self.stages
        )
        return max(0.0, room / self.settings.gpu_memory_gib)

    def table(self) -> str:
        s = self.settings
        rows = [
            f"{'stage':>5} {'ranks':>11} {'params':>8} {'weights':>8} {'ref':>6} {'critic':>6} "
            f"{'rm':>6} {'grads':>7} "
            f"{'optim':>7} {'act':>7} {'act(rc)':>7} {'rollout':>7} {'other':>6} "
            f"{'train':>7} {'gen':>7}  (GiB)"
        ]
        for r in self.stages:
            rollout = max(r.rollout_training, r.rollout_generating)
            rows.append(
                f"{r.stage:>5} {f'{r.ranks[0]}-{r.ranks[1]}':>11} "
                f"{_count(r.params.total):>8} {r.weights:>8.1f} {r.reference:>6.1f} "
                f"{r.critic:>6.1f} {r.reward_model:>6.1f} {r.grads:>7.1f} "
                f"{r.optimizer:>7.1f} {r.activations_full:>7.1f} {r.activations_recompute:>7.1f} "
                f"{rollout:>7.1f} {r.overhead + r.fragmentation:>6.1f} "
                f"{r.training_peak:>7.1f} {r.generation_peak:>7.1f}"
                + ("  <- worst" if r is self.worst and len(self.stages) > 1 else "")
            )
        w = self.worst
        verdict = "fits" if self.fits else "DOES NOT FIT"
        rows.append(
            f"worst rank: stage {w.stage} (ranks {w.ranks[0]}-{w.ranks[1]}), peak {w.peak:.1f} of "
            f"{s.gpu_memory_gib:.1f} GiB -> {verdict} "
            f"(activations {'with' if s.recompute else 'without'} recomputation, "
            f"{s.micro_batch_tokens} tokens/micro-batch, {w.in_flight} in flight; "
            f"distributed optimizer {'on' if s.distributed_optimizer else 'off'})"
        )
        return "\n".join(rows)

    def advice(self) -> str:
        """What to change when the plan does not fit."""
        if self.fits:
            return ""
        w, s = self.worst, self.settings
        if w.static + w.overhead > s.gpu_memory_gib:
            tip = (
                f"parameters, gradients and optimizer state alone take {w.static:.1f} GiB per "
                "GPU: use more GPUs, with more expert parallelism (parallel.ep; experts hold "
                "most parameters), pipeline stages (parallel.pp) or tensor parallelism "
                "(parallel.tp)"
            )
            if not s.distributed_optimizer:
                tip += ", or shard the optimizer state: optimizer.distributed_optimizer=true"
            if w.reference:
                tip += (
                    f"; the KL reference's weights take {w.reference:.1f} GiB of it "
                    "(algorithm.kl_coef=0 drops the reference)"
                )
            if w.critic:
                tip += f"; PPO's critic takes {w.critic:.1f} GiB of it"
            if w.reward_model:
                tip += f"; the reward model's weights take {w.reward_model:.1f} GiB of it"
            return tip
        tips = []
        if not s.recompute and w.activations_full > w.activations_recompute:
            tips.append("engine.recompute_activations=true")
        if w.activations > 1:
            tips.append("a smaller engine.max_tokens_per_microbatch")
        if w.generation_peak >= w.training_peak and s.offload_during_rollout != "all":
            tips.append(
                "trainer.offload_during_rollout=all (the training state leaves while generating)"
            )
        if s.rollout.server_fraction:
            tips.append(
                f"colocated rollout servers holding at most {self.max_server_fraction:.2f} of "
                f"each GPU ({s.rollout.fraction_key}), or servers on their own nodes "
                "(slurm/train_disaggregated.sbatch)"
            )
        tips.append("more GPUs")
        return "; or ".join(tips)

    def to_dict(self) -> dict[str, Any]:
        w = self.worst
        return {
            "fits": self.fits,
            "gpu_memory_gib": self.settings.gpu_memory_gib,
            "worst_stage": w.stage,
            "worst_ranks": list(w.ranks),
            "worst_peak_gib": round(w.peak, 3),
            "model_params": model_params(self.model),
            "active_params": active_params(self.model),
            "layout": self.layout.describe(),
            "stages": [
                {
                    "stage": r.stage,
                    "ranks": list(r.ranks),
                    "params": r.params.total,
                    "dense_params": r.params.dense,
                    "expert_params": r.params.expert,
                    "weights_gib": r.weights,
                    "reference_gib": r.reference,
                    "critic_gib": r.critic,
                    "reward_model_gib": r.reward_model,
                    "grads_gib": r.grads,
                    "optimizer_gib": r.optimizer,
                    "activations_gib": r.activations,
                    "activations_no_recompute_gib": r.activations_full,
                    "activations_recompute_gib": r.activations_recompute,
                    "in_flight": r.in_flight,
                    "rollout_training_gib": r.rollout_training,
                    "rollout_generating_gib": r.rollout_generating,
                    "overhead_gib": r.overhead + r.fragmentation,
                    "training_peak_gib": r.training_peak,
                    "generation_peak_gib": r.generation_peak,
                    "offloaded_while_generating_gib": r.offloaded,
                }
                for r in self.stages
            ],
        }


def plan(model: ModelConfig, layout: ParallelLayout, settings: PlanSettings) -> MemoryPlan:
    """The per-stage memory plan of `model` trained on `layout`."""
    b = DTYPE_BYTES[model.params_dtype]
    tokens = settings.micro_batch_tokens
    layer_act = layer_activation_bytes(model, layout, tokens, settings.moe_imbalance)
    layer_in = layer_input_bytes(model, layout, tokens)
    per_stage = layout.world_size // layout.pp
    chunk_layers = model.num_hidden_layers // (layout.pp * layout.vpp)
    stages = []
    for stage in range(layout.pp):
        params = stage_params(model, layout, stage, settings.lora)
        chunks = in_flight_chunks(layout, stage, settings.microbatches)
        full = chunks * chunk_layers * layer_act
        recompute = chunks * chunk_layers * layer_in + layer_act
        if stage == layout.pp - 1:
            vocab = model.padded_vocab_size(layout.tp) // layout.tp
            head = 2 * tokens / layout.cp * vocab * b + 0.25 * GIB  # logits + grad, fp32 chunks
            head += 2 * layer_in  # final norm input, output-layer input
            full += head
            recompute += head
        act = recompute if settings.recompute else full
        gen, train = _rollout_share(model, layout, settings, stage)
        weights, grads, optimizer = training_state_gib(
            model, layout, stage, settings, settings.lora
        )
        reference = weights if settings.reference_model else 0.0
        critic = critic_optimizer = 0.0
        if settings.critic_model:
            critic_layout = settings.critic_layout or layout
            ranks_per_critic_stage = critic_layout.world_size // critic_layout.pp
            states = [
                training_state_gib(model, critic_layout, critic_stage, settings)
                for critic_stage in sorted(
                    {
                        r // ranks_per_critic_stage
                        for r in range(stage * per_stage, (stage + 1) * per_stage)
                    }
                )
            ]
            critic, critic_optimizer = max((sum(state), state[2]) for state in states)
        reward_model = 0.0
        if settings.reward_model is not None:
            reward_model = training_state_gib(settings.reward_model, layout, stage, settings)[0]
        offloaded = 0.0
        if settings.offload_during_rollout != "none":
            offloaded = optimizer + critic_optimizer
        if settings.offload_during_rollout == "all":
            offloaded += (
                grads
                + reference
                + (critic - critic_optimizer)
                + (0.0 if settings.rollout.keeps_policy_weights else weights)
            )
        stages.append(
            RankMemory(
                stage=stage,
                ranks=(stage * per_stage, (stage + 1) * per_stage - 1),
                params=params,
                weights=weights,
                reference=reference,
                critic=critic,
                critic_optimizer=critic_optimizer,
                reward_model=reward_model,
                grads=grads,
                optimizer=optimizer,
                activations_full=full / GIB,
                activations_recompute=recompute / GIB,
                activations=act / GIB,
                in_flight=chunks,
                rollout_training=train,
                rollout_generating=gen,
                overhead=settings.overhead_gib,
                fragmentation=settings.fragmentation * act / GIB,
                offloaded=offloaded,
            )
        )
    return MemoryPlan(model=model, layout=layout, settings=settings, stages=tuple(stages))


def training_state_gib(
    model: ModelConfig,
    layout: ParallelLayout,
    stage: int,
    settings: PlanSettings,
    lora: LoRASettings | None = None,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) in GiB of a rank of pipeline stage `stage`; with
    `lora`, gradients and optimizer state of its adapters only."""
    b = DTYPE_BYTES[model.params_dtype]
    # Adam: exp_avg + exp_avg_sq, plus a float32 master copy of low-precision weights.
    optim_bytes = 8 + (4 if b < 4 else 0)
    dense_shard = layout.dp * layout.cp if settings.distributed_optimizer else 1
    expert_shard = layout.edp if settings.distributed_optimizer else 1
    params = stage_params(model, layout, stage, lora)
    dense, expert = params.trained
    optimizer = optim_bytes * (dense / dense_shard + expert / expert_shard)
    return params.total * b / GIB, (dense + expert) * 4 / GIB, optimizer / GIB


def _rollout_share(
    model: ModelConfig, layout: ParallelLayout, settings: PlanSettings, stage: int
) -> tuple[float, float]:
    """(while generating, while training) GiB of the colocated rollout engine."""
    r = settings.rollout
    generating = training = 0.0
    if r.kv_cache_tokens:
        b = DTYPE_BYTES[model.params_dtype]
        layers = model.num_hidden_layers // layout.pp
        kv_heads = math.ceil(model.num_key_value_heads / layout.tp)
        cache = (r.kv_cache_tokens + r.kept_kv_tokens) * layers * 2 * kv_heads * model.head_dim * b
        prefill = layer_activation_bytes(model, layout, r.kv_cache_tokens * layout.cp)
        generating += (cache + prefill) / GIB
    unsplit = layout.tp == layout.ep == layout.etp == layout.pp == 1
    lora = settings.lora
    if r.merges_adapters_per_batch and unsplit and lora is not None and lora.enabled:
        b = DTYPE_BYTES[model.params_dtype]
        adapted = lora_adapted_weight_params(model, lora) * model.num_hidden_layers
        generating += adapted * b / GIB
    if r.server_fraction:
        held = r.server_fraction * settings.gpu_memory_gib
        generating += held
        training += held if r.server_idle_gib is None else r.server_idle_gib
    return generating, training


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


# -- from the run configuration ------------------------------------------------------------------


def settings_from_config(
    run_cfg: Any,
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    gpu_memory_gib: float,
    recompute: bool | None = None,
    moe_imbalance: float = 1.0,
    overhead_gib: float = 3.0,
) -> PlanSettings:
    """PlanSettings for a resolved RunConfig (gspo_megatron.config.resolve)."""
    engine, rollout, alg = run_cfg.engine, run_cfg.rollout, run_cfg.algorithm
    responses = rollout.prompts_per_step * rollout.group_size
    per_rank = max(1, responses // alg.num_minibatches // layout.dp)
    step_tokens = per_rank * engine.max_sequence_length
    tokens = min(engine.max_tokens_per_microbatch, step_tokens)
    try:
        share = memory_share(rollout)
    except ValueError as err:
        raise PlanError(str(err)) from err
    microbatches = max(1, math.ceil(step_tokens / engine.max_tokens_per_microbatch))
    return PlanSettings(
        micro_batch_tokens=tokens,
        microbatches=microbatches,
        distributed_optimizer=run_cfg.optimizer.distributed_optimizer,
        recompute=engine.recompute_activations if recompute is None else recompute,
        gpu_memory_gib=gpu_memory_gib,
        rollout=share,
        moe_imbalance=moe_imbalance,
        overhead_gib=overhead_gib,
        reference_model=(alg.kl_coef > 0 or alg.kl_reward_coef > 0) and not run_cfg.lora.enabled,
        lora=run_cfg.lora if run_cfg.lora.enabled else None,
        critic_model=alg.advantage == "gae",
        critic_layout=run_cfg.critic_layout(layout.world_size) if alg.advantage == "gae" else None,
        reward_model=_reward_model_config(run_cfg.reward.model_path, model),
        offload_during_rollout=run_cfg.trainer.offload_during_rollout,
    )


def _reward_model_config(path: str | None, policy: ModelConfig) -> ModelConfig | None:
    """reward.model_path's architecture, in the policy's dtype (as gspo-train loads it)."""
    if not path:
        return None
    from gspo_megatron.checkpoint.reading import read_model_config

    try:
        return read_model_config(path, params_dtype=policy.params_dtype)
    except (OSError, ValueError) as err:
        raise PlanError(f"reward.model_path={path}: {err}") from err


def fit_warning(
    run_cfg: Any, model: ModelConfig, layout: ParallelLayout, gpu_memory_gib: float
) -> str | None:
    """What the memory plan says when this run does not fit the GPUs, else None."""
    settings = settings_from_config(run_cfg, model, layout, gpu_memory_gib=gpu_memory_gib)
    memory = plan(model, layout, settings)
    if memory.fits:
        return None
    return (
        f"the memory plan (tools/plan_memory.py) says this run does not fit in "
        f"{gpu_memory_gib:.1f} GiB per GPU; change: {memory.advice()}"
    )
