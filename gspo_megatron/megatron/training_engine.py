"""The training engine: a megatron-core policy, its optimizer, and the RL loss in the schedule.

Normalisation (docs/ARCHITECTURE.md §4): every loss is Σ per-item terms / D with D counted once per
optimizer step over all micro-batches and data-parallel ranks. We run megatron with
`calculate_per_token_loss=False`, where the schedule divides each micro-batch's loss by its
returned token count (we return 1) and by the micro-batch count M, and DDP scales gradients by
1/(dp*cp) before summing them. Returning loss_sum * M * dp * cp / D per micro-batch therefore
makes the accumulated gradient exactly ∇(Σ terms / D) for any M, DP, CP or PP — and leaves the
MoE aux loss on megatron's standard path (averaged over micro-batches and DP).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial, reduce, wraps

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.inference.utils import InferenceMode
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from gspo_megatron.algorithms.gae import value_loss_terms
from gspo_megatron.algorithms.losses import get_policy_loss, policy_loss_terms
from gspo_megatron.algorithms.metrics import (
    CLIP_BUCKET_PREFIX,
    clip_buckets,
    finalize_metrics,
    metric_reduce_op,
)
from gspo_megatron.config_fields import raise_on_problems
from gspo_megatron.device import accelerator, pinned_for_accelerator
from gspo_megatron.megatron.attention import PackedRowsParams
from gspo_megatron.megatron.batch import (
    MicroBatch,
    assemble_cp_rows,
    build_microbatch,
    denominator_of,
    padded_length,
    plan_packed,
    plan_padded,
)
from gspo_megatron.megatron.logprobs import vocab_parallel_logprobs
from gspo_megatron.megatron.lora import freeze_base, init_adapters
from gspo_megatron.megatron.model import build_model_chunks, transformer_config
from gspo_megatron.megatron.offload import StateOffloader
from gspo_megatron.megatron.parallel import LayoutGroups
from gspo_megatron.megatron.routing import RouteRecorder
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings, resolve_modules_to_save
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import ModelConfig
from gspo_megatron.spec.sample import TrainSample, validate_samples
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings


@dataclass
class ForwardResult:
    """Per-sample, response-aligned outputs of a forward pass (identical on every rank)."""

    logprobs: list[np.ndarray] | None = None  # a policy's
    values: list[np.ndarray] | None = None  # a value model's: V of the state before each token
    entropy: list[np.ndarray] | None = None
    routes: list[np.ndarray] | None = None  # int16 [len-1, moe_layers, top_k]


class NonFiniteError(RuntimeError):
    pass


# Module attributes that switch sequence parallelism on (generation runs without it).
_SEQUENCE_PARALLEL_ATTRS = (
    "sequence_parallel",
    "scatter_to_sequence_parallel",
    "reduce_scatter_embeddings",
)


def _on_own_layout(method):
    """Runs an engine method inside the engine's parallel state (TrainingEngine.own_layout)."""

    @wraps(method)
    def run(self, *args, **kwargs):
        with self.own_layout():
            return method(self, *args, **kwargs)

    return run


class TrainingEngine:
    """Policy model chunks + optimizer for one parallel layout; called identically on all ranks.

    engine, optimizer: the `engine` and `optimizer` config sections. decay_steps: optimizer
    steps the learning rate decays over (None: the schedule stays at lr after warmup).
    moe_aux_loss / moe_aux_loss_coef: the MoE load-balancing loss (algorithm.moe_aux_loss).
    A frozen engine (`frozen_copy`) holds weights only: no DDP gradient buffers, no optimizer;
    it can run `forward` (with routing replay) and nothing that trains.
    value_head: a value model (PPO's critic) or reward model: the same architecture ending in a
    scalar head (`model.ValueHead`); `forward` returns values, `train_value_step` trains it.
    groups: megatron's parallel state for `layout` when it is not the one `parallel.initialize`
    made (a critic on a layout of its own); the engine is built, runs and is checkpointed inside
    it (`own_layout`).
    lora: LoRA adapters (the `lora` section; megatron/lora.py): the base weights frozen, DDP and
    the optimizer holding the adapters only; lora_seed draws their A (the run's seed).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        layout: ParallelLayout,
        engine: EngineSettings | None = None,
        optimizer: OptimizerSettings | None = None,
        *,
        decay_steps: int | None = None,
        moe_aux_loss: str = "none",
        moe_aux_loss_coef: float = 0.0,
        trainable: bool = True,
        value_head: bool = False,
        groups: LayoutGroups | None = None,
        lora: LoRASettings | None = None,
        lora_seed: int = 0,
    ) -> None:
        if groups is not None and groups.layout != layout:
            raise ValueError(f"groups were made for {groups.layout}, not for {layout}")
        self.parallel_groups = groups
        self.lora = lora if lora is not None and lora.enabled else None
        with self.own_layout():
            self._build(
                model_config, layout, engine, optimizer, decay_steps,
                moe_aux_loss, moe_aux_loss_coef, trainable, value_head, lora_seed,
            )  # fmt: skip

    def own_layout(self) -> contextlib.AbstractContextManager:
        """megatron's parallel state of this engine's layout, for the block it encloses (a no-op
        on the layout `parallel.initialize` made). Collective operations on the engine's
        weights outside its methods (checkpoints, weight loading) run inside it."""
        if self.parallel_groups is None:
            return contextlib.nullcontext()
        return self.parallel_groups.active()

    def _build(
        self,
        model_config: ModelConfig,
        layout: ParallelLayout,
        engine: EngineSettings | None,
        optimizer: OptimizerSettings | None,
        decay_steps: int | None,
        moe_aux_loss: str,
        moe_aux_loss_coef: float,
        trainable: bool,
        value_head: bool,
        lora_seed: int,
    ) -> None:
        self.model_config = model_config
        self.value_head = value_head
        self.layout = layout
        self.settings = engine or EngineSettings()
        self.optim_settings = optimizer or OptimizerSettings()
        raise_on_problems(self.settings, "engine")
        raise_on_problems(self.optim_settings, "optimizer")
        if self.lora is not None:
            raise_on_problems(self.lora, "lora")
            if self.lora.dropout:
                raise ValueError("lora.dropout > 0 is not built yet (docs/LORA.md)")
            if value_head:
                raise ValueError("LoRA on a value model is not built yet (docs/LORA.md)")
        self.decay_steps = decay_steps
        layout.check_model(
            num_layers=model_config.num_hidden_layers,
            num_attention_heads=model_config.num_attention_heads,
            num_key_value_heads=model_config.num_key_value_heads,
            num_experts=model_config.num_experts if model_config.is_moe else None,
        )
        self.config = transformer_config(
            model_config,
            layout,
            recompute=self.settings.recompute_activations,
            moe_aux_loss=moe_aux_loss if trainable else "none",
            moe_aux_loss_coef=moe_aux_loss_coef,
        )
        self.trainable = trainable
        self.steps_done = 0
        self.lr_scale = 1.0  # set_lr_scale: a factor on the schedule's learning rate
        # Of the last planned batch (see _plan): padding_fraction, dp_token_imbalance.
        self.batch_stats: dict[str, float] = {}
        self._offloader: StateOffloader | None = None
        # every module of the chunks, listed on first use by _set_training ([]: not usable)
        self._training_flags: list[torch.nn.Module] | None = None
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._cp_group = parallel_state.get_context_parallel_group()
        if model_config.is_moe:
            self.config.moe_enable_routing_replay = True
        chunks = build_model_chunks(
            model_config,
            layout,
            config=self.config,
            use_te=self.settings.use_te,
            value_head=value_head,
            lora=self.lora,
        )
        if self.lora is not None:
            init_adapters(chunks, lora_seed)
            freeze_base(
                chunks,
                resolve_modules_to_save(
                    self.lora.modules_to_save, model_config.tie_word_embeddings
                ),
            )
        if not trainable:
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
            self.model: list[torch.nn.Module] = chunks
            self.optimizer = self.scheduler = None
            self.routes = RouteRecorder(self.model, self.config) if model_config.is_moe else None
            return
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.optim_settings.distributed_optimizer,
        )
        self.model = [
            DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk)
            for chunk in chunks
        ]
        self.optimizer = get_megatron_optimizer(self._optimizer_config(), self.model)
        self.scheduler = self._scheduler()
        self.config.finalize_model_grads_func = grad_finalizer(self.model, self.config)
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.routes = RouteRecorder(self.model, self.config) if model_config.is_moe else None

    @classmethod
    def frozen_copy(cls, policy: TrainingEngine) -> TrainingEngine:
        """A frozen engine holding `policy`'s current weights (the KL reference: the initial
        policy when called before training and before a resume loads a checkpoint)."""
        frozen = cls(
            policy.model_config,
            policy.layout,
            policy.settings,
            trainable=False,
            value_head=policy.value_head,
            groups=policy.parallel_groups,
            lora=policy.lora,
        )
        with torch.no_grad():
            for mine, theirs in zip(frozen.model, policy.unwrapped_chunks, strict=True):
                mine.load_state_dict(theirs.state_dict())
        return frozen

    @_on_own_layout
    def load_trunk_from(self, policy: TrainingEngine) -> None:
        """A value model starting from a policy: every weight of `policy` but its output layer
        (the vocabulary projection); the value head keeps its own. Same layout, collective-free.
        """
        if not self.value_head or policy.value_head:
            raise RuntimeError("load_trunk_from copies a policy's trunk into a value model")
        if self.layout != policy.layout:
            raise RuntimeError(
                "load_trunk_from copies shards of the same layout; a value model on a layout of "
                "its own loads the policy's weights from a checkpoint (checkpoint.load_engine_"
                "weights with head='init')"
            )
        with torch.no_grad():
            for mine, theirs in zip(self.unwrapped_chunks, policy.unwrapped_chunks, strict=True):
                state = theirs.state_dict()
                trunk = {k: v for k, v in state.items() if not k.startswith("output_layer.")}
                missing, _ = mine.load_state_dict(trunk, strict=False)
                left = [k for k in missing if not k.startswith("output_layer.")]
                if left:
                    raise RuntimeError(f"the policy has no weight for the value model's {left[0]}")
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # -- construction -------------------------------------------------------------------------

    def _optimizer_config(self) -> OptimizerConfig:
        s = self.optim_settings
        dtype = self.config.params_dtype
        return OptimizerConfig(
            optimizer=s.name,
            sgd_momentum=0.0,
            lr=s.lr,
            min_lr=s.min_lr,
            weight_decay=s.weight_decay,
            adam_beta1=s.adam_beta1,
            adam_beta2=s.adam_beta2,
            adam_eps=s.adam_eps,
            clip_grad=s.clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=s.distributed_optimizer,
        )

    def _scheduler(self) -> OptimizerParamScheduler:
        s = self.optim_settings
        decay_steps = self.decay_steps or max(1, s.warmup_steps) + 1
        style = s.decay_style if self.decay_steps else "constant"
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if s.warmup_steps else s.lr,
            max_lr=s.lr,
            min_lr=s.min_lr,
            lr_warmup_steps=s.warmup_steps,
            lr_decay_steps=max(decay_steps, s.warmup_steps + 1),
            lr_decay_style=style,
            start_wd=s.weight_decay,
            end_wd=s.weight_decay,
            wd_incr_steps=max(decay_steps, 1),
            wd_incr_style="constant",
        )

    # -- public API -----------------------------------------------------------------------------

    # -- what the embedded rollout engine uses (rollout/embedded/in_process.py) --------------
    # `unwrapped_chunks` (the modules to run), `model_config`, `layout`, `settings`, `config`
    # (megatron's TransformerConfig), `routes` (the RouteRecorder, MoE only) and
    # `generation_mode()`; nothing else of the engine's state.

    @contextlib.contextmanager
    def generation_mode(self, record_routes: bool = False) -> Iterator[None]:
        """For GPTModel forwards outside the schedule: eval mode, megatron's inference flag, no
        sequence parallelism, and the experts each token chooses recorded when asked.

        Sequence parallelism splits a sequence over TP ranks, which a one-token decode step
        cannot be; it is switched off on every module that holds it and restored afterwards.
        """
        if self.parallel_groups is not None:
            raise RuntimeError("generation runs on the layout parallel.initialize made")
        training = [m.training for m in self.model]
        saved: list[tuple[object, str, bool]] = []
        if self.config.sequence_parallel:
            for chunk in self.unwrapped_chunks:
                for module in chunk.modules():
                    for attr in _SEQUENCE_PARALLEL_ATTRS:
                        if getattr(module, attr, None) is True:
                            saved.append((module, attr, True))
                            setattr(module, attr, False)
            saved.append((self.config, "sequence_parallel", True))
            self.config.sequence_parallel = False
        routes = self.routes if record_routes else None
        for m in self.model:
            m.eval()
        try:
            if routes is not None:
                routes.begin(record=True, replay=False, count=False)
            with torch.no_grad(), InferenceMode.active():
                yield
        finally:
            if routes is not None:
                routes.end()
            for obj, attr, value in saved:
                setattr(obj, attr, value)
            for m, mode in zip(self.model, training, strict=True):
                m.train(mode)

    @_on_own_layout
    def offload(self, what: str, *, keep_weights: bool) -> dict[str, float]:
        """Move `what` (optimizer | all) of this engine's state to host memory and free its
        device storage, keeping the weights if `keep_weights` (gspo_megatron/megatron/offload.py).
        Returns the seconds and bytes copied. Nothing runs on the engine until `reload`."""
        offloader = self._offloader
        if offloader is None or (offloader.what, offloader.keep_weights) != (what, keep_weights):
            if offloader is not None and offloader.offloaded:
                raise RuntimeError("the engine's state is offloaded: reload it before changing")
            self._offloader = offloader = StateOffloader(self, what, keep_weights=keep_weights)
        return offloader.offload()

    @_on_own_layout
    def reload(self) -> dict[str, float]:
        """Put offloaded state back on the device; nothing to do when it is resident."""
        return self._offloader.reload() if self._offloader is not None else {}

    @property
    def offloaded(self) -> bool:
        return self._offloader is not None and self._offloader.offloaded

    @_on_own_layout
    def close(self) -> None:
        """Let the model, optimizer and process groups be freed once the caller drops the engine.

        Megatron's DDP keeps each parameter's grad-accumulator node (`grad_accs`) with a hook
        that holds the DDP module, and modules keep tensors of their last forward (the MoE
        token dispatcher's routing probabilities) whose autograd graphs reach those nodes:
        reference cycles through C++ objects, which the garbage collector cannot see. Without
        this, every engine of a process lives until it exits, with its process groups' threads
        (about 60 per training run on CPU).
        """
        for chunk in self.model:
            if isinstance(chunk, DistributedDataParallel):
                chunk.grad_accs.clear()
            for module in chunk.modules():
                _drop_autograd_graphs(module)
                for helper in vars(module).values():  # e.g. MoELayer.token_dispatcher
                    if not isinstance(helper, torch.nn.Module) and hasattr(helper, "__dict__"):
                        _drop_autograd_graphs(helper)
        self.config.grad_scale_func = None

    def _check_resident(self) -> None:
        if self.offloaded:
            raise RuntimeError("the engine's state is offloaded: call reload() before using it")

    def _set_training(self, mode: bool) -> None:
        """`chunk.train(mode)` on every chunk. nn.Module.train walks the module tree and sets
        each flag through Module.__setattr__ on every call; here the modules are listed once and
        the flag set directly: the same result, since none of them overrides `train` (checked;
        otherwise every chunk's own `train` runs)."""
        if self._training_flags is None:
            modules = [m for chunk in self.model for m in chunk.modules()]
            plain = all(type(m).train is torch.nn.Module.train for m in modules)
            self._training_flags = modules if plain else []
        if not self._training_flags:
            for chunk in self.model:
                chunk.train(mode)
            return
        for module in self._training_flags:
            # what Module.__setattr__ does for an attribute that is no parameter, buffer or module
            object.__setattr__(module, "training", mode)

    @property
    def unwrapped_chunks(self) -> list[torch.nn.Module]:
        return [m.module for m in self.model] if self.trainable else list(self.model)

    @_on_own_layout
    def forward(
        self,
        samples: Sequence[TrainSample],
        *,
        with_entropy: bool = False,
        record_routes: bool = False,
        replay_routes: bool = False,
    ) -> ForwardResult:
        """Per-token log-probs (and entropy) of the samples' responses, or a value model's
        values; no gradients.

        record_routes: also return each token's experts (routing replay R2). replay_routes:
        route with the samples' `routed_experts` (R3: the rollout engine's routes).
        """
        self._check_resident()
        validate_samples(samples, self.settings.max_sequence_length)
        self._set_training(False)
        want_routes = record_routes and self.routes is not None
        replay = replay_routes and self.routes is not None
        outputs: list[dict] = []

        def loss_fn(mb: MicroBatch, output: torch.Tensor):
            out = {"indices": mb.indices, "seq_lengths": mb.seq_lengths}
            if self.value_head:
                out["values"] = self._token_values(mb, output).detach()
            else:
                lp, ent = self._token_logprobs(mb, output, with_entropy)
                out["logprobs"] = lp.detach()
                if ent is not None:
                    out["entropy"] = ent.detach()
            return torch.zeros((), device=output.device), torch.tensor(1), out

        with torch.no_grad():
            per_mb = self._run_schedule(
                samples,
                loss_fn,
                forward_only=True,
                token_advantages=False,
                record_routes=want_routes,
                replay_routes=replay,
                route_sink=outputs,
            )
        if self.trainable:
            self._set_training(True)
        routes = self.routes.collect(samples, outputs) if want_routes else None
        if self.value_head:
            values = self._collect_per_token(samples, per_mb, "values")
            return ForwardResult(values=values, routes=routes)
        logprobs = self._collect_per_token(samples, per_mb, "logprobs")
        entropy = self._collect_per_token(samples, per_mb, "entropy") if with_entropy else None
        return ForwardResult(logprobs=logprobs, entropy=entropy, routes=routes)

    @_on_own_layout
    def train_step(
        self,
        samples: Sequence[TrainSample],
        loss: LossSettings,
        *,
        replay_routes: bool = False,
        entropy_metric: bool = True,
        route_metrics: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on `samples` (the whole minibatch, identical on every rank).

        With `replay_routes`, MoE layers route with the samples' `routed_experts`; without it,
        given routes are only compared with the current ones (moe/route_change_fraction).
        entropy_metric / route_metrics: whether this step computes actor/entropy (with
        engine.entropy_metric; a loss with an entropy term always does) and the moe/* route
        metrics (logging.costly_metrics_every, gspo_megatron/metrics_schedule.py).
        """
        self._check_trainable(want_value_head=False)
        validate_samples(samples, self.settings.max_sequence_length)
        if any(s.old_logprobs is None for s in samples):
            raise ValueError("train_step needs old_logprobs on every sample")
        if loss.kl_coef and any(s.ref_logprobs is None for s in samples):
            raise ValueError("algorithm.kl_coef > 0 needs reference log-probs on every sample")
        seq_share = 1.0 / self.layout.cp
        cp_sum = self._cp_sum if self.layout.cp > 1 else None
        with_entropy = loss.entropy_coef > 0 or (self.settings.entropy_metric and entropy_metric)

        def loss_terms(mb: MicroBatch, logits: torch.Tensor):
            lp, ent = self._token_logprobs(mb, logits, with_entropy)
            extra = {}
            if loss.kl_coef:
                extra = {
                    "ref_logprobs": mb.ref_logprobs,
                    "kl_coef": loss.kl_coef,
                    "kl_estimator": loss.kl_estimator,
                }
            if loss.entropy_coef:
                extra |= {"entropy": ent, "entropy_coef": loss.entropy_coef}
            lengths = torch.tensor(
                [len(samples[i].response_ids) for i in mb.indices], device=lp.device
            )
            terms = policy_loss_terms(
                loss.name,
                lp,
                mb.old_logprobs,
                mb.advantages,
                mb.loss_mask,
                seq_sum=cp_sum,
                seq_share=torch.full((lp.shape[0],), seq_share, device=lp.device),
                is_weights=mb.is_weights,
                # Non-finite values are caught once per step (engine.nonfinite), not per call.
                check_values=False,
                token_buckets=clip_buckets(mb.version_lags, lengths, loss.max_new_tokens),
                **loss.hparams,
                **extra,
            )
            logs = dict(terms.metric_sums)
            if ent is not None:
                logs["entropy/sum"] = (ent.detach() * mb.loss_mask).sum().double()
                logs["entropy/count"] = mb.loss_mask.sum().double()
            return terms.loss_sum, logs

        return self._optimizer_step(
            samples,
            loss_terms,
            self._global_denominator(samples, loss),
            record_routes=route_metrics
            and not replay_routes
            and any(s.routed_experts is not None for s in samples),
            replay_routes=replay_routes and self.routes is not None,
            route_metrics=route_metrics,
        )

    @_on_own_layout
    def train_value_step(
        self, samples: Sequence[TrainSample], *, clip: float | None
    ) -> dict[str, float]:
        """One optimizer step of a value model on `samples` (each with old_values and returns):
        PPO's value loss, clipped to `clip` around the old values (None: unclipped), averaged
        over the minibatch's trained tokens (algorithms/gae.py)."""
        self._check_trainable(want_value_head=True)
        validate_samples(samples, self.settings.max_sequence_length)
        if any(s.old_values is None or s.returns is None for s in samples):
            raise ValueError("train_value_step needs old_values and returns on every sample")
        # Tokens that train: nonzero mask entries, as value_loss_terms counts them.
        tokens = sum(
            len(s.response_ids) if s.loss_mask is None else sum(m != 0 for m in s.loss_mask)
            for s in samples
        )

        def loss_terms(mb: MicroBatch, output: torch.Tensor):
            values = self._token_values(mb, output)
            terms = value_loss_terms(values, mb.old_values, mb.returns, mb.loss_mask, clip=clip)
            return terms.loss_sum, dict(terms.metric_sums)

        return self._optimizer_step(samples, loss_terms, float(max(tokens, 1)))

    def _check_trainable(self, *, want_value_head: bool) -> None:
        if not self.trainable:
            raise RuntimeError("a frozen engine (the KL reference, a reward model) cannot train")
        if self.value_head != want_value_head:
            raise RuntimeError(
                "train_value_step trains a value model, train_step a policy; this engine is a "
                + ("value model" if self.value_head else "policy")
            )
        self._check_resident()

    def _optimizer_step(
        self,
        samples: Sequence[TrainSample],
        loss_terms: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]],
        denominator: float,
        *,
        record_routes: bool = False,
        replay_routes: bool = False,
        route_metrics: bool = True,
    ) -> dict[str, float]:
        """Run the schedule with `loss_terms(mb, output) -> (loss_sum, metric_sums)` in it,
        normalised by the global `denominator` (§4 of docs/ARCHITECTURE.md), and take one
        optimizer step unless a loss or gradient is non-finite; with `route_metrics` the
        routers' counts (moe/*) too."""
        dp_cp = self.layout.dp * self.layout.cp
        num_mb_holder: list[int] = []

        def loss_fn(mb: MicroBatch, output: torch.Tensor):
            loss_sum, metric_sums = loss_terms(mb, output)
            scale = num_mb_holder[0] * dp_cp / denominator
            logs = {key: value.detach().double() for key, value in metric_sums.items()}
            logs["loss_sum/sum"] = loss_sum.detach().double()
            return loss_sum * scale, torch.tensor(1), logs

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        per_mb = self._run_schedule(
            samples,
            loss_fn,
            forward_only=False,
            # the advantages travel in the micro-batch as the samples hold them
            token_advantages=any(isinstance(s.advantage, list) for s in samples),
            num_microbatches_out=num_mb_holder,
            record_routes=record_routes,
            replay_routes=replay_routes,
            count_routes=route_metrics,
        )
        metrics = finalize_metrics(
            self._reduce_metric_sums(per_mb), omit_empty=(CLIP_BUCKET_PREFIX,)
        )
        metrics["loss"] = metrics.pop("loss_sum") / denominator
        metrics["num_microbatches"] = float(num_mb_holder[0])  # on this rank
        metrics.update(self.batch_stats)
        finite = self._all_finite(metrics["loss"])
        if not finite:
            if self.settings.nonfinite == "raise":
                raise NonFiniteError(
                    f"non-finite loss or gradient at optimizer step {self.steps_done + 1} "
                    "(engine.nonfinite=raise); set engine.nonfinite=skip to skip such steps"
                )
            self.optimizer.zero_grad()
            metrics.update(skipped=1.0, grad_norm=float("nan"), lr=self.current_lr())
            return metrics
        success, grad_norm, _ = self.optimizer.step()
        self.step_schedule(1)
        self.steps_done += 1
        metrics.update(
            skipped=0.0 if success else 1.0,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.current_lr(),
        )
        if self.routes is not None and route_metrics:
            metrics.update(self.routes.step_metrics())
        return metrics

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr_scale(self, scale: float) -> None:
        """From now on the learning rate is the schedule's times `scale` (the collapse
        sentinel's remedy: gspo_megatron/stability/rollback.py); the schedule itself, a function
        of the optimizer step, is unchanged."""
        if scale != self.lr_scale:
            self.lr_scale = scale
            self.step_schedule(0)

    def step_schedule(self, increment: int) -> None:
        """Advance the LR schedule by `increment` optimizer steps and set every parameter
        group's learning rate: the schedule's value times `lr_scale`."""
        self.scheduler.step(increment=increment)
        if self.lr_scale != 1.0:
            for group in self.optimizer.param_groups:
                if isinstance(group["lr"], torch.Tensor):  # as the scheduler sets it: in place
                    group["lr"].mul_(self.lr_scale)
                else:
                    group["lr"] = group["lr"] * self.lr_scale

    # -- schedule plumbing -----------------------------------------------------------------------

    def _token_logprobs(self, mb: MicroBatch, logits: torch.Tensor, with_entropy: bool):
        """Log-probs (and entropy) of the labels, in the micro-batch's row layout."""
        logprobs, entropy = vocab_parallel_logprobs(
            logits,
            mb.labels,
            vocab_size=self.model_config.vocab_size,
            tp_group=self._tp_group,
            with_entropy=with_entropy,
            chunk_bytes=self.settings.logprob_chunk_bytes,
        )
        return mb.rows(logprobs), mb.rows(entropy) if entropy is not None else None

    def _token_values(self, mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
        """A value head's output ([b, s, 1] or [1, T, 1]) in the row layout, in float32."""
        return mb.rows(output[..., 0].float())

    def _microbatches(
        self, samples: Sequence[TrainSample], token_advantages: bool
    ) -> list[MicroBatch]:
        plans = self._plan(samples)
        cp_rank = parallel_state.get_context_parallel_rank()
        # Built on the host, in pinned memory on a GPU: each is copied to the device as the
        # schedule reaches it, so at most the micro-batches in flight occupy device memory.
        return [
            build_microbatch(
                samples,
                group,
                multiple=self.layout.sequence_multiple,
                pad_id=0,  # padding is masked out; any id in the vocabulary will do
                cp_size=self.layout.cp,
                cp_rank=cp_rank,
                token_advantages=token_advantages,
                packed=self.settings.pack_sequences,
            ).map(pinned_for_accelerator)
            for group in plans[parallel_state.get_data_parallel_rank()]
        ]

    def _plan(self, samples: Sequence[TrainSample]) -> list[list[list[int]]]:
        """Every DP rank's micro-batches (sample indices), computed alike on every rank, and
        `batch_stats`: the share of computed tokens that is padding, and the most tokens a DP
        rank computes over the mean."""
        layout = self.layout
        # The interleaved schedule needs the micro-batch count to be a multiple of pp.
        count_multiple = layout.pp if layout.vpp > 1 else 1
        multiple = layout.sequence_multiple
        lengths = [s.length for s in samples]
        budget = self.settings.max_tokens_per_microbatch
        if self.settings.pack_sequences:
            seq_multiple = 2 * layout.cp if layout.cp > 1 else 1
            padded = [padded_length(n, seq_multiple) for n in lengths]
            plans = plan_packed(padded, layout.dp, budget, count_multiple)
            computed = [
                sum(padded_length(sum(padded[i] for i in g), multiple) for g in plan)
                for plan in plans
            ]
        else:
            plans = plan_padded(lengths, layout.dp, budget, multiple, count_multiple)
            computed = [
                sum(len(g) * padded_length(max(lengths[i] for i in g), multiple) for g in plan)
                for plan in plans
            ]
        self.batch_stats = {
            "padding_fraction": 1.0 - sum(lengths) / sum(computed),
            "dp_token_imbalance": max(computed) * len(computed) / sum(computed),
        }
        return plans

    def _run_schedule(
        self,
        samples: Sequence[TrainSample],
        loss_fn: Callable[[MicroBatch, torch.Tensor], tuple],
        *,
        forward_only: bool,
        token_advantages: bool,
        num_microbatches_out: list[int] | None = None,
        record_routes: bool = False,
        replay_routes: bool = False,
        route_sink: list | None = None,
        count_routes: bool = True,
    ) -> list[dict]:
        microbatches = self._microbatches(samples, token_advantages)
        if num_microbatches_out is not None:
            num_microbatches_out.append(len(microbatches))
        routes = self.routes
        if routes is not None:
            routes.begin(record=record_routes, replay=replay_routes, count=count_routes)
        device = accelerator()

        def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data_iterator).to(device)
            vp_stage = getattr(getattr(model, "module", model), "vp_stage", None)
            if routes is not None:
                routes.before_forward(mb, vp_stage)
            output = model(
                mb.tokens, mb.position_ids, None, packed_seq_params=_packed_seq_params(mb)
            )
            if routes is not None:
                routes.after_forward(mb, vp_stage, route_sink)
            return output, partial(loss_fn, mb)

        iterators: Iterator | list[Iterator]
        if self.layout.vpp > 1:
            iterators = [iter(microbatches) for _ in range(self.layout.vpp)]
        else:
            iterators = iter(microbatches)
        schedule = get_forward_backward_func()
        try:
            results = schedule(
                forward_step_func=forward_step,
                data_iterator=iterators,
                model=self.model,
                num_microbatches=len(microbatches),
                seq_length=max(mb.tokens.shape[1] for mb in microbatches),
                micro_batch_size=max(mb.tokens.shape[0] for mb in microbatches),
                forward_only=forward_only,
            )
        finally:
            if routes is not None:
                routes.end()
        return list(results)

    def _global_denominator(self, samples: Sequence[TrainSample], loss: LossSettings) -> float:
        """D of the normalisation contract over the whole minibatch (known before the forward)."""
        per_token = get_policy_loss(loss.name).denominator == "tokens"
        return float(max(denominator_of(samples, per_token), 1))

    def _cp_sum(self, partial_sums: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(partial_sums, self._cp_group)

    def _all_finite(self, loss_value: float) -> bool:
        buffers = [b for m in self.model for b in (*m.buffers, *m.expert_parallel_buffers)]
        if dist.get_world_size() == 1 and len(buffers) == 1:
            # the common case of one process: one reduction, read once
            return math.isfinite(loss_value) and bool(torch.isfinite(buffers[0].grad_data.sum()))
        # Counted on the device and read once: no host sync per gradient buffer.
        nonfinite = torch.full(
            (1,), 0.0 if math.isfinite(loss_value) else 1.0, device=accelerator()
        )
        for buffer in buffers:
            nonfinite += ~torch.isfinite(buffer.grad_data.sum())
        if dist.get_world_size() > 1:
            dist.all_reduce(nonfinite)
        return nonfinite.item() == 0.0

    # -- gathering results ---------------------------------------------------------------------

    def _reduce_metric_sums(self, per_mb: list[dict]) -> dict[str, float]:
        """Combine micro-batch metric sums over micro-batches and DP x CP ranks, per key's op.

        TP ranks hold identical values and are not summed; pipeline ranks other than the last
        receive the result.
        """
        result: dict[str, float] = {}
        if self._is_last_stage():
            key_ops = {k: metric_reduce_op(k) for k in sorted(per_mb[0].keys())}
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            alone = dist.get_world_size(group) == 1
            reduced, names = [], []
            # Sums in one all-reduce; maxima and minima (negated) in one MAX all-reduce.
            for ops, torch_op in (
                (("sum",), dist.ReduceOp.SUM),
                (("max", "min"), dist.ReduceOp.MAX),
            ):
                op_keys = [k for k, op in key_ops.items() if op in ops]
                if not op_keys:
                    continue
                # One float64 vector per micro-batch, combined left to right on the device.
                vectors = (torch.stack([d[k] for k in op_keys]) for d in per_mb)
                if ops == ("sum",):
                    local = reduce(torch.add, vectors)
                    if not alone:
                        dist.all_reduce(local, op=torch_op, group=group)
                    reduced.append(local)
                else:
                    signs = torch.tensor(
                        [-1.0 if key_ops[k] == "min" else 1.0 for k in op_keys],
                        dtype=torch.float64,
                        device=per_mb[0][op_keys[0]].device,
                    )
                    local = reduce(torch.maximum, (vector * signs for vector in vectors))
                    if not alone:
                        dist.all_reduce(local, op=torch_op, group=group)
                    reduced.append(local * signs)
                names.extend(op_keys)
            # read back once
            result.update(zip(names, torch.cat(reduced).tolist(), strict=True))
        return self._broadcast_from_last_stage(result)

    def _is_last_stage(self) -> bool:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    def _broadcast_from_last_stage(self, obj):
        if self.layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return box[0]

    def _collect_per_token(
        self, samples: Sequence[TrainSample], per_mb: list[dict], key: str
    ) -> list[np.ndarray]:
        """Response-aligned per-token values for every sample, on every rank."""
        local: dict[int, np.ndarray] = {}
        for out in per_mb:
            values = self._gather_cp(out[key], out["seq_lengths"]).cpu().numpy()
            for row, index in enumerate(out["indices"]):
                s = samples[index]
                start = len(s.prompt_ids) - 1
                local[index] = values[row, start : start + len(s.response_ids)].copy()
        merged: dict[int, np.ndarray] = {}
        if self.layout.dp == 1:
            merged = local
        else:
            gathered: list = [None] * self.layout.dp
            group = parallel_state.get_data_parallel_group()
            dist.all_gather_object(gathered, local, group=group)
            for part in gathered:
                merged.update(part)
        merged = self._broadcast_from_last_stage(merged)
        return [merged[i] for i in range(len(samples))]

    def _gather_cp(self, values: torch.Tensor, seq_lengths: torch.Tensor) -> torch.Tensor:
        """This CP rank's row layout -> [b, s] in sequence order."""
        if self.layout.cp == 1:
            return values.float()
        parts = [torch.empty_like(values) for _ in range(self.layout.cp)]
        dist.all_gather(parts, values.contiguous(), group=self._cp_group)
        return assemble_cp_rows(parts, seq_lengths.tolist()).float()


def grad_finalizer(model: list[DistributedDataParallel], config) -> Callable:
    """What the schedule calls after the last backward: megatron's `finalize_model_grads`, or
    in a one-process job, where every collective it makes is over a group of one, only its
    bookkeeping (`_finalize_one_process`).

    The shortcut is taken only when it is provably the same: one process; gradients not scaled
    before their reduction (a factor of 1: 1/dp); no fp32 copies to move into and out of the
    communication buffer; and none of finalize_model_grads' local updates in use (the expert
    bias, the global aux loss's tracker, quantile balancing, GTP, flextron).
    """
    groups = [
        g for chunk in model for g in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
    ]
    buckets = [b for g in groups for b in g.buckets]
    balancing = config.moe_router_load_balancing_type
    alone = (
        dist.get_world_size() == 1
        and all(
            b.gradient_scaling_factor == 1.0 and not b.params_with_extra_main_grads for b in buckets
        )
        and not any(g.ddp_config.overlap_grad_reduce for g in groups)
        and not config.moe_router_enable_expert_bias
        and "global_aux_loss" not in balancing
        and balancing != "quantile_balancing"
        and config.gtp_weight_remat_size <= 1
        and config.expert_gtp_weight_remat_size <= 1
        and not getattr(config, "flextron", False)
        and not config.calculate_per_token_loss
    )
    return partial(_finalize_one_process, groups) if alone else finalize_model_grads


def _finalize_one_process(groups: list, model, num_tokens=None, **_) -> None:
    """finalize_model_grads of one process: its reductions leave every gradient as it is (a
    reduce-scatter or all-reduce over one rank); what is left is to mark the parameters' gather
    as not yet dispatched, as its grad-sync does."""
    if num_tokens is not None:
        raise RuntimeError("per-token loss scaling is not used by this engine")
    for group in groups:
        group.param_gather_dispatched = False


def _packed_seq_params(mb: MicroBatch) -> PackedRowsParams | None:
    if not mb.packed:
        return None
    return PackedRowsParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        cu_seqlens_q_padded=mb.cu_seqlens,
        cu_seqlens_kv_padded=mb.cu_seqlens,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
        row_shapes=mb.attention_shapes,
        row_index=mb.attention_index,
        row_inverse=mb.attention_inverse,
    )


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group in the forward; the backward sums the output gradients the same way.

    Every rank's copy of the sum feeds its own loss, so the gradient reaching each rank's input
    is the sum of all ranks' output gradients.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _drop_autograd_graphs(obj: object) -> None:
    """Forget `obj`'s tensor attributes that carry an autograd graph (cached activations)."""
    for name, value in list(vars(obj).items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            setattr(obj, name, None)
