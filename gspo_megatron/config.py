"""The run configuration: these dataclasses are the one definition of every setting, its
default and its allowed values, validated before any work.

They are Hydra's schema (`register_schema`: conf/config.yaml starts from it); the preset files of
the groups model/ algorithm/ parallel/ rollout/ data/ reward/ env/ eval/ hold only what a preset
changes. `resolve()` turns the composed config into these dataclasses, refusing unknown keys
with their full path, checking every value, and deriving the values that depend on several
sections, in one place. Nothing here imports megatron.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from gspo_megatron import CONF_DIR
from gspo_megatron.config_fields import (
    ConfigError,
    bounded,
    check_fields,
    choice,
    open_mapping,
)
from gspo_megatron.data.config import DataConfig
from gspo_megatron.data.tokenizer import CHAR_TOKENIZER_NAMES
from gspo_megatron.envs.registry import EnvConfig
from gspo_megatron.evaluation.config import EvalConfig, benchmark_reading, benchmark_reward
from gspo_megatron.rewards.registry import RewardConfig
from gspo_megatron.rollout.backends import rollout_backend
from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import (
    LoRASettings,
    resolve_modules_to_save,
    resolve_targets,
)
from gspo_megatron.spec.model_config import ModelConfig
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings


def open_in_hydra(factory) -> Any:
    """A section Hydra composes as a plain mapping, so that `+section.key=value` adds a key as
    it always has; `resolve` builds the dataclass and checks its keys, naming them."""
    return field(default_factory=factory, metadata={"open_in_hydra": True})


@dataclass
class ModelSection:
    """`model/`: a preset's architecture fields (ModelConfig) plus where to start from.

    name: preset name (informational). init_from: null (random init), a HF checkpoint
    directory, or a gspo-megatron checkpoint (weights only). tokenizer: "char" (the synthetic
    tasks' character tokenizer) or a HF tokenizer directory; null uses init_from when it is a HF
    directory.
    """

    name: str = "tiny_moe"
    init_from: str | None = None
    tokenizer: str | None = "char"
    architecture: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields

    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig(**self.architecture)
        except TypeError as err:
            raise ConfigError(f"model: {err}") from err


@dataclass
class ParallelSection:
    """`parallel/`: degrees of parallelism; dp follows from the number of processes."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False

    def layout(self, world_size: int) -> ParallelLayout:
        return ParallelLayout(world_size=world_size, **dataclasses.asdict(self))


@dataclass
class AlgorithmSection:
    """`algorithm/`: the policy loss and everything that shapes its inputs.

    loss: gspo | gspo_token | ppo | grpo | dapo | dr_grpo | sapo | cispo | gmpo. The loss's own
    hyper-parameters (clip_low, clip_high, clip_c, tau_pos, tau_neg, max_response_length) go
    in `hparams`; unset ones take the paper defaults (docs/ALGORITHMS.md).
    advantage: group_mean_std | group_mean | gae; null = the loss's paper estimator. gae:
    PPO's generalised advantage estimation with a learned critic (the `critic` section) over
    per-token rewards (the reward at the last model token, minus kl_reward_coef x the
    kl_estimator's per-token KL to the initial policy), with gamma and lam, the advantages
    whitened over the batch when whiten_advantages.
    credit: episode | turn. episode: one advantage per response (an episode's step rewards
    summed into its reward). turn (multi-turn episodes, env.name): each model turn's
    discounted return (turn_gamma per turn) against the group's episodes at the same turn
    index, given to the turn's tokens (algorithms/advantages.py; docs/ENVIRONMENTS.md,
    "Per-turn credit"); needs a loss that takes token advantages (gspo_token, not gspo); with
    advantage=gae each turn's reward lands on its last token and GAE discounts per token.
    num_minibatches: optimizer steps per rollout batch (the GSPO paper uses 4).
    old_logprobs: recompute (trainer forward) | rollout (the rollout engine's log-probs).
    routing_replay: off | r2 (replay the old-policy forward's routes) | r3 (the rollout
    engine's routes).
    dynamic_sampling: none | dapo (drop zero-variance groups, refill with more prompts) |
    dupo (fill their slots with copies of informative groups).
    overlong_filter: drop truncated responses from the loss. overlong_penalty_length /
    overlong_penalty_cache: DAPO's soft overlong punishment (Lmax, Lc; 0 = off).
    mismatch: none | tis | mis (train/rollout correction) at mismatch_level with cap/bounds.
    kl_coef / kl_estimator: KL to the initial policy (k1 | k2 | k3 | low_var_kl).
    entropy_coef: an entropy bonus: the loss minus entropy_coef x the policy's entropy on the
    trained tokens, aggregated like the KL penalty (0 = off).
    moe_aux_loss: none | aux_loss | seq_aux_loss | global_aux_loss, megatron-core's MoE
    load-balancing loss added to the policy loss with weight moe_aux_loss_coef. Off by default:
    RL fine-tunes a router that is already balanced, and the extra gradient moves routes the
    rollout engine then no longer reproduces (docs/ALGORITHMS.md).
    """

    loss: str = "gspo"
    hparams: dict[str, Any] = open_mapping()
    advantage: str | None = choice(None, "group_mean_std", "group_mean", "gae")
    advantage_eps: float = bounded(1e-6, ge=0)
    gamma: float = bounded(1.0, ge=0, le=1)
    lam: float = bounded(0.95, ge=0, le=1)
    whiten_advantages: bool = True
    credit: str = choice("episode", "turn")
    turn_gamma: float = bounded(1.0, ge=0, le=1)
    kl_reward_coef: float = bounded(0.0, ge=0)
    num_minibatches: int = bounded(4, ge=1)
    old_logprobs: str = choice("recompute", "rollout")
    routing_replay: str = choice("off", "r2", "r3")
    dynamic_sampling: str = choice("none", "dapo", "dupo")
    max_refill_rounds: int = bounded(4, ge=0)
    prefilter_solved_prompts: bool = False
    overlong_filter: bool = False
    overlong_penalty_length: int = bounded(0, ge=0)
    overlong_penalty_cache: int = bounded(0, ge=0)
    mismatch: str = choice("none", "tis", "mis")
    mismatch_level: str = choice("token", "sequence", "geometric")
    mismatch_cap: float = bounded(2.0, gt=0)
    mismatch_lower: float = bounded(0.5, ge=0)
    mismatch_upper: float = bounded(2.0, gt=0)
    kl_coef: float = bounded(0.0, ge=0)
    kl_estimator: str = choice("k3", "k1", "k2", "low_var_kl")
    entropy_coef: float = bounded(0.0, ge=0)
    moe_aux_loss: str = choice("none", "aux_loss", "seq_aux_loss", "global_aux_loss")
    moe_aux_loss_coef: float = bounded(0.0, ge=0)

    def loss_hparams(self, max_new_tokens: int) -> dict[str, Any]:
        """The loss's hyper-parameters; Dr.GRPO's constant defaults to rollout.max_new_tokens."""
        hparams = {k: v for k, v in self.hparams.items() if v is not None}
        if self.loss == "dr_grpo":
            hparams.setdefault("max_response_length", max_new_tokens)
        return hparams


CriticParallelSection = dataclasses.make_dataclass(
    "CriticParallelSection",
    [
        (f.name, typing.Optional[typing.get_type_hints(ParallelSection)[f.name]], None)  # noqa: UP045
        for f in dataclasses.fields(ParallelSection)
    ],
    namespace={
        "__doc__": "`critic.parallel`: the keys of `parallel/`, each null = the policy's value.",
        "layout": lambda self, policy, world_size: ParallelLayout(
            world_size=world_size,
            **{
                name: getattr(policy, name) if value is None else value
                for name, value in dataclasses.asdict(self).items()
            },
        ),
    },
)
CriticParallelSection.__module__ = __name__


@dataclass
class CriticSection:
    """`critic`: PPO's value model, built when algorithm.advantage=gae: the policy's
    architecture on the policy's parallel layout, ending in a scalar head (docs/ALGORITHMS.md,
    "PPO with a critic").

    init_from: null = the policy's starting weights (model.init_from, or the same seeded
    initialisation) with a zero head; or a Hugging Face *ForSequenceClassification directory
    with one label (a reward model), or a gspo-megatron checkpoint of a value model.
    value_clip: the value loss's clipping around the values the batch was generated with (0 =
    unclipped). warmup_steps: the first RL steps train the critic only. optimizer: the critic's
    own optimizer and learning-rate schedule (the `optimizer` section's keys). parallel: the
    critic's own parallel layout over the same processes: any key of `parallel/` (null keys
    take the policy's value, so by default the critic shares the policy's layout); a different
    layout gets process groups of its own (docs/ALGORITHMS.md, "PPO with a critic").
    """

    init_from: str | None = None
    value_clip: float = bounded(0.2, ge=0)
    warmup_steps: int = bounded(0, ge=0)
    optimizer: OptimizerSettings = field(default_factory=lambda: OptimizerSettings(lr=1e-3))
    parallel: CriticParallelSection = field(default_factory=CriticParallelSection)


@dataclass
class RolloutSection:
    """`rollout/`: how responses are generated.

    engine: embedded (in-process, default) | sglang: a name in ROLLOUT_BACKENDS
    (gspo_megatron/rollout/backends.py). prompts_per_step × group_size responses
    per RL step. Sampling: temperature, top_p, top_k (-1 off), max_new_tokens (evaluation's
    sampling is the `eval` section's; the default 5 fits the default task: a 3-digit answer,
    the end token, and one token more, so that running past the answer costs credit).
    sglang: the SGLang engine's section (gspo_megatron/rollout/sglang/config.py,
    SGLangEngineConfig), read with rollout.engine=sglang.
    mode: sync (generate, then train) | one_step_off (batch k+1 generates while batch k trains,
    with the weights from before step k) | async (queue_batches batches generate ahead, taking
    new weights between any two tokens: partial rollouts). One_step_off and async run the
    embedded engine in a generator process of its own (gspo_megatron/rollout/embedded/generator.py);
    SGLang servers generate the batches ahead, a weight update aborting (async) or waiting for
    (one_step_off) the requests running.
    max_staleness: no trained token was sampled by weights more than this many versions older
    than the ones that train on it (batches start only within the bound). queue_batches: how
    many batches async mode keeps submitted ahead. partial_rollout_mask: (async) leave out of
    the loss the tokens a response sampled before its last weight swap.
    pin_versions: (async, embedded engine) sample each batch with one weight version, the
    newest when it is submitted (or the bound's, if newer), instead of taking new weights between
    tokens: which weights sample which batch no longer depends on timing, so a run, killed and
    resumed or not, is deterministic; one_step_off always does (docs/ROLLOUT.md, "Checkpoints").
    prefix_cache_tokens: (embedded engine) keys and values of finished sequences kept between
    generate calls, at most this many tokens (0: none kept), when an environment runs episodes
    (env.name; single-turn prompts never start with a finished sequence): a multi-turn episode's
    next turn prefills only the tokens its context adds (docs/ROLLOUT.md, "Context kept between
    turns").
    Dropped by every weight update; in rollout.mode=sync held while a step's rollouts run and
    dropped before training, in the generator process of one_step_off / async held until its
    next weight update. Each token costs layers x 2 x kv heads x head dim x the dtype's bytes.
    """

    engine: str = "embedded"  # a name of rollout/backends.py's ROLLOUT_BACKENDS
    mode: str = choice("sync", "one_step_off", "async")
    max_staleness: int = bounded(1, ge=0)
    queue_batches: int = bounded(2, ge=1)
    partial_rollout_mask: bool = False
    pin_versions: bool = False
    prompts_per_step: int = bounded(8, ge=1)
    group_size: int = bounded(16, ge=2)
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(-1, ge=1, special=(-1,))
    max_new_tokens: int = bounded(5, ge=1)
    max_batch_tokens: int = bounded(16384, ge=1)
    prefix_cache_tokens: int = bounded(16384, ge=0)
    sglang: SGLangEngineConfig = open_in_hydra(SGLangEngineConfig)


@dataclass
class TrainerSection:
    """`trainer`: the run's length and its schedule of checkpoints (evaluation's: `eval.every`).

    steps: RL steps (each = one rollout batch and algorithm.num_minibatches optimizer steps).
    save_every / save_every_minutes: a checkpoint every
    N RL steps or T minutes, whichever comes first (0 turns either off); one is always written
    at the end and on SIGTERM/SIGINT. keep_last: intact checkpoints kept (older ones are
    deleted, newer ones never). resume: auto (the newest checkpoint of this run directory that
    validates on every rank; a directory whose checkpoints all fail is an error) | never (a
    fresh start, refused in a directory holding checkpoints) | a checkpoint path.
    allow_different_config: resume a run directory whose saved config differs.
    max_consecutive_skipped_steps: with engine.nonfinite=skip, the run stops after this many
    skipped optimizer steps in a row.
    peer_timeout_s: a rank whose heartbeat stops this long is declared gone, and every rank
    exits with a message instead of waiting in a collective (gspo_megatron/peers.py).
    offload_during_rollout: none | optimizer (optimizer state and fp32 main parameters) | all
    (also gradient buffers and weights) move to host memory while rollouts generate and come
    back before the old-policy forward. With the embedded rollout engine the weights stay
    (they generate); with SGLang they leave after the weight sync. The KL reference's weights
    leave too under `all`.
    export_hf_every: every N RL steps (0: never), and at the end, the checkpoint also gets
    `hf/`: the policy as a Hugging Face model (safetensors, config, tokenizer; a LoRA policy's
    merged, base + alpha/r * B @ A), written by every rank, verified against the trainer (its
    tensors and its log-probs under transformers), in the checkpoint's manifest
    (docs/CHECKPOINTS.md, "Hugging Face export"). Such a step is always checkpointed.
    export_hf_on_failure: continue (the failed export is kept as `hf.failed/` and named in one
    line) | stop (then the run stops, its checkpoint intact).
    """

    steps: int = bounded(800, ge=1)
    save_every: int = bounded(100, ge=0)
    save_every_minutes: float = bounded(30.0, ge=0)
    keep_last: int = bounded(2, ge=1)
    resume: str = "auto"
    allow_different_config: bool = False
    max_consecutive_skipped_steps: int = bounded(16, ge=1)
    peer_timeout_s: float = bounded(60.0, gt=0)
    offload_during_rollout: str = choice("none", "optimizer", "all")
    export_hf_every: int = bounded(0, ge=0)
    export_hf_on_failure: str = choice("continue", "stop")


@dataclass
class LoggingSection:
    """`logging/`: metrics.jsonl is always written; TensorBoard and W&B optional."""

    progress: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "gspo-megatron"
    # MoE expert-load and route-change metrics. They ride on the old-policy forward (or, with
    # algorithm.old_logprobs=rollout, on the rollout's routes under R3) and never add a forward.
    moe_route_metrics: bool = True
    # The step interval of the metrics that cost work beyond the step's own (metrics_schedule.py):
    # actor/entropy (engine.entropy_metric), the MoE route metrics (the routes recorded in the
    # old-policy forward, moe/expert_load*, moe/route_flips*, the training forwards' route-change
    # counts and their reduction over ranks) and the train/rollout mismatch/* metrics. They are
    # computed on steps that are multiples of it and on the last; what a stability check reads
    # (stability.sentinel.entropy_fraction, stability.mismatch_budget.k3_kl / route_flips) is
    # computed every step. Every other metric is in every step's record.
    costly_metrics_every: int = bounded(1, ge=1)


@dataclass
class MismatchBudgetSection:
    """`stability.mismatch_budget`: how much rollout/trainer mismatch a run tolerates, and what
    it does past that (docs/STABILITY.md, "The mismatch budget").

    k3_kl: the mean over `window` steps of mismatch/k3_kl (KL(rollout || trainer) per token, on
    the tokens the rollout engine sampled; 0 = not budgeted). route_flips: the mean over `window`
    steps of moe/route_flips (the fraction of tokens whose experts differ between the rollout
    engine and the trainer, over the MoE layers; 0 = not budgeted). remedy, when either is
    exceeded: warn (a line and stability/mismatch_over_budget) | mis (turn on algorithm.mismatch
    =mis at algorithm.mismatch_level, once) | lower_staleness (rollout.max_staleness - 1, down
    to 1) | stop (a checkpoint, then a stop). After an action the window starts again.
    """

    k3_kl: float = bounded(0.0, ge=0)
    route_flips: float = bounded(0.0, ge=0, le=1)
    window: int = bounded(10, ge=1)
    remedy: str = choice("warn", "mis", "lower_staleness", "stop")


@dataclass
class SentinelSection:
    """`stability.sentinel`: watch the run for a collapse and roll back to the newest healthy
    checkpoint (docs/STABILITY.md, "The collapse sentinel").

    enabled: act (roll back) when it fires; false still measures and logs what it would do.
    Signals, each against its exponential moving average over `window` steps (updated only while
    no signal is active), evaluated after `warmup_steps` steps:
    reward_drop: reward/mean below its moving average by more than this (reward units), for
    reward_patience steps in a row (0 = off). entropy_fraction: actor/entropy below this fraction
    of its moving average, for entropy_patience steps (0 = off), watched only while that average
    is at least entropy_floor nats per token (a policy already near-deterministic cannot turn
    so; 0 = at any level). grad_norm_factor: the step's largest pre-clipping gradient norm
    (actor/grad_norm_max) above this multiple of its moving average, for grad_norm_patience
    steps (0 = off); with grad_norm_requires_reward_dip, only on steps whose reward/mean is below
    its moving average (an optimizer out of its basin shows in the reward; a converged policy's
    gradient spikes on its rare failures do not). nonfinite_patience: steps in a row with a
    non-finite loss, gradient (skipped optimizer steps), entropy or reward (0 = off; from step
    1). on_mismatch_budget: the mismatch budget exceeded is a signal too.
    remedy after a rollback: skip_window_lower_lr (the prompts drawn since the checkpoint are
    skipped and the policy's learning rate is multiplied by lr_factor for lr_steps steps) |
    skip_window | lower_lr | resample (the same prompts again). Every rollback also draws new
    sampling seeds. max_rollbacks: rollbacks in one run directory; one more firing stops it.
    """

    enabled: bool = True
    window: int = bounded(20, ge=2)
    warmup_steps: int = bounded(20, ge=0)
    reward_drop: float = bounded(0.2, ge=0)
    reward_patience: int = bounded(5, ge=1)
    entropy_fraction: float = bounded(0.1, ge=0, lt=1)
    entropy_patience: int = bounded(5, ge=1)
    entropy_floor: float = bounded(0.05, ge=0)
    grad_norm_factor: float = bounded(10.0, gt=1, special=(0,))
    grad_norm_patience: int = bounded(3, ge=1)
    grad_norm_requires_reward_dip: bool = True
    nonfinite_patience: int = bounded(2, ge=0)
    on_mismatch_budget: bool = False
    remedy: str = choice("skip_window_lower_lr", "skip_window", "lower_lr", "resample")
    lr_factor: float = bounded(0.5, gt=0, lt=1)
    lr_steps: int = bounded(50, ge=1)
    max_rollbacks: int = bounded(3, ge=1)

    @property
    def lowers_lr(self) -> bool:
        return self.remedy in ("skip_window_lower_lr", "lower_lr")

    @property
    def skips_window(self) -> bool:
        return self.remedy in ("skip_window_lower_lr", "skip_window")


@dataclass
class StabilitySection:
    """`stability`: guardrails, telemetry thresholds, the mismatch budget and the collapse
    sentinel (docs/STABILITY.md).

    allow_clip_scale_mismatch: run a loss whose clip range is at the other scale than the ratio
    it clips (a sequence-level ratio with clip >= 0.01, a token-level one below it), which is
    otherwise refused. mismatch_token_threshold: a token counts in
    mismatch/tokens_past_threshold when its rollout and trainer log-probs differ by more.
    """

    allow_clip_scale_mismatch: bool = False
    mismatch_token_threshold: float = bounded(0.2, gt=0)
    mismatch_budget: MismatchBudgetSection = field(default_factory=MismatchBudgetSection)
    sentinel: SentinelSection = field(default_factory=SentinelSection)


@dataclass
class RunConfig:
    """The whole run. seed: changes every random choice of the run (initialisation, data order,
    sampling)."""

    seed: int = bounded(0, ge=0)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    critic: CriticSection = field(default_factory=CriticSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    lora: LoRASettings = field(default_factory=LoRASettings)
    logging: LoggingSection = field(default_factory=LoggingSection)
    stability: StabilitySection = field(default_factory=StabilitySection)

    @property
    def decay_steps(self) -> int | None:
        """Optimizer steps the policy's learning rate decays over: the whole run, unless it is
        constant."""
        return self.decay_steps_of(self.optimizer)

    def critic_layout(self, world_size: int) -> ParallelLayout:
        """The critic's parallel layout (critic.parallel over the policy's `parallel`)."""
        with _keys_of_the_critic():
            return self.critic.parallel.layout(self.parallel, world_size)

    def decay_steps_of(self, optimizer: OptimizerSettings) -> int | None:
        """Optimizer steps `optimizer`'s learning rate decays over (the critic's too)."""
        if optimizer.decay_style == "constant":
            return None
        return self.trainer.steps * self.algorithm.num_minibatches


@contextlib.contextmanager
def _keys_of_the_critic():
    """A layout error of the critic's layout, naming critic.parallel.* keys."""
    try:
        yield
    except ValueError as err:
        raise ConfigError(str(err).replace("parallel.", "critic.parallel.")) from err


_MODEL_EXTRA_KEYS = {"name", "init_from", "tokenizer"}
# Keys of earlier versions: the old key -> what replaces it.
_RENAMED = {
    **{f"trainer.{name}": f"optimizer.{name}" for name in (
        "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
        "warmup_steps", "decay_style", "distributed_optimizer")},
    **{f"trainer.{name}": f"engine.{name}" for name in (
        "max_sequence_length", "max_tokens_per_microbatch", "nonfinite", "recompute_activations")},
    "trainer.eval_every": "eval.every",
    "rollout.eval_temperature": "eval.heldout.temperature",
    "rollout.eval_samples": "eval.heldout.samples",
    "rollout.eval_prompts": "eval.heldout.problems",
}  # fmt: skip
_REMOVED = {
    "model.router_aux_loss_coef": "the MoE load-balancing loss of RL training is "
    "algorithm.moe_aux_loss (none | aux_loss | seq_aux_loss | global_aux_loss) with "
    "algorithm.moe_aux_loss_coef",
    "rollout.weight_sync_bucket_mb": "it was never read; the bucket size of weight updates to "
    "SGLang is rollout.sglang.bucket_bytes",
}


def old_key_message(key: str) -> str | None:
    """What to use instead of `key` when it is a key of an earlier version, else None."""
    if key in _RENAMED:
        return f"{key} is now {_RENAMED[key]}"
    if key in _REMOVED:
        return f"{key} is no longer a setting: {_REMOVED[key]}"
    return None


def register_schema() -> None:
    """Store these dataclasses in Hydra's ConfigStore as `gspo_config`, the node conf/config.yaml
    starts from (call before composing). The model section is a plain mapping there: its keys
    are a preset's ModelConfig fields, checked by `resolve`; so are mappings of sections
    (eval.benchmarks), so that a new entry can be given whole on the command line, and the
    sections marked `open_in_hydra` (rollout.sglang). The `open_mapping` fields (env.kwargs,
    algorithm.hparams) take new keys without `+`."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="gspo_config", node=_hydra_schema(RunConfig))


_MAPPING = {"mapping": True}  # a field of a Hydra schema that is a plain mapping


def _hydra_schema(cls) -> type:
    """`cls` with its mappings of dataclasses (and the model section) as plain mappings."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        if (
            (cls is RunConfig and f.name == "model")
            or f.metadata.get("open_in_hydra")
            or (typing.get_origin(hint) is dict and args and dataclasses.is_dataclass(args[1]))
        ):
            fields.append((f.name, dict[str, Any], field(default_factory=dict, metadata=_MAPPING)))
        elif f.metadata.get("open_keys"):
            fields.append(
                (f.name, Any, field(default_factory=_open_dict_config, metadata=f.metadata))
            )
        elif dataclasses.is_dataclass(hint) and (schema := _hydra_schema(hint)) is not hint:
            fields.append((f.name, schema, field(default_factory=_as_schema(f, schema))))
        else:
            fields.append((f.name, hint, f))
    if all(f is g[2] for f, g in zip(dataclasses.fields(cls), fields, strict=True)):
        return cls
    return dataclasses.make_dataclass(cls.__name__, fields)


def _open_dict_config(content: dict | None = None):
    """A mapping that stays open when Hydra makes the config struct: its owner checks its keys
    (`open_mapping`), so `env.kwargs.max_guesses=8` needs no `+`."""
    from omegaconf import DictConfig

    return DictConfig(content or {}, flags={"struct": False})


def _schema_default(f: dataclasses.Field, value: Any) -> Any:
    """A schema field's value from its section's default: mappings empty (their content comes
    from the presets), open mappings open."""
    if f.metadata.get("mapping"):
        return {}
    if f.metadata.get("open_keys"):
        return _open_dict_config(value)
    return value


def _as_schema(f: dataclasses.Field, schema: type):
    """A default factory of `schema` holding the values of field `f`'s default."""

    def make():
        default = f.default_factory()
        return schema(
            **{
                g.name: _schema_default(g, getattr(default, g.name))
                for g in dataclasses.fields(schema)
            }
        )

    return make


def compose(overrides: list[str]) -> dict[str, Any]:
    """The config `gspo-train OVERRIDES` composes, as a plain dict (hydra.* overrides are left
    out). Old keys on the command line are refused with their new names."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    check_overrides(overrides)
    register_schema()
    own = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=own)
    return OmegaConf.to_container(cfg, resolve=True)


def help_text(program: str, overrides: list[str]) -> str:
    """`PROGRAM --help`: the config groups and their options (conf/), and the config that
    `overrides` compose. Hydra's own --help lists the groups by composing the config once per
    option (~1 s of CPU here), so the console scripts answer --help with this instead; Hydra's
    flags stay behind --hydra-help."""
    from omegaconf import OmegaConf

    groups = sorted(
        (d.name, sorted(f.stem for f in d.glob("*.yaml")))
        for d in CONF_DIR.iterdir()
        if d.is_dir() and d.name != "hydra" and any(d.glob("*.yaml"))
    )
    lines = [
        f"{program} [OVERRIDES]: compose the configuration from the groups below (group=option)",
        "and override any key (key=value, +key=value to add one). Hydra's own flags (--cfg, -m,",
        "--info, ...): --hydra-help.",
        "",
        "== Configuration groups ==",
        *(f"{name}: {', '.join(options)}" for name, options in groups),
        "",
        "== Config ==",
        OmegaConf.to_yaml(compose(overrides)).rstrip(),
    ]
    return "\n".join(lines)


def check_overrides(overrides: list[str]) -> None:
    """Refuse command-line overrides of keys of earlier versions, naming the new key (before
    Hydra, whose own error names only the old one)."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if message := old_key_message(key):
            raise ConfigError(message)


def resolve(
    raw: dict[str, Any],
    world_size: int = 1,
    *,
    check_inputs: bool = True,
    for_training: bool = True,
) -> tuple[RunConfig, ModelConfig, ParallelLayout]:
    """Composed config dict -> validated RunConfig, ModelConfig and ParallelLayout.

    check_inputs: what the run needs from outside must be here: the input files the config
    names, SGLang servers (off for dry runs elsewhere).
    for_training: training prompts are needed (gspo-eval needs none).
    """
    raw = dict(raw)
    raw.pop("hydra", None)
    model_raw = dict(raw.pop("model", {}) or {})
    sections = {**raw, "model": model_raw}
    for key in [*_RENAMED, *_REMOVED]:
        section, name = key.split(".", 1)
        if isinstance(sections.get(section), dict) and name in sections[section]:
            raise ConfigError(old_key_message(key))
    architecture = {k: v for k, v in model_raw.items() if k not in _MODEL_EXTRA_KEYS}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(architecture) - model_fields)
    if unknown:
        raise ConfigError(f"unknown config key model.{unknown[0]}")
    section = {k: v for k, v in model_raw.items() if k in _MODEL_EXTRA_KEYS}
    cfg = _build(RunConfig, raw, "")
    cfg.model = ModelSection(**section, architecture=architecture)
    problems = check_fields(cfg, "")
    if problems:
        raise ConfigError(
            problems[0] + (f" (and {len(problems) - 1} more)" if problems[1:] else "")
        )
    try:
        model = cfg.model.model_config()
        layout = cfg.parallel.layout(world_size)
        _check_layout_fits(layout, model, cfg)
        if cfg.algorithm.advantage == "gae":
            critic_layout = cfg.critic_layout(world_size)
            with _keys_of_the_critic():
                _check_layout_fits(critic_layout, model, cfg)
        cfg.data.validate(for_training=for_training)
        cfg.reward.validate()
        cfg.env.validate()
        cfg.eval.validate()
        for name, bench in cfg.eval.benchmarks.items():
            benchmark_reward(cfg.reward, bench, f"eval.benchmarks.{name}")
            benchmark_reading(cfg.data, bench, f"eval.benchmarks.{name}")
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err
    _check(cfg, model, layout)
    if check_inputs and (missing := missing_inputs(cfg)):
        raise ConfigError(missing[0])
    return cfg, model, layout


def _check_layout_fits(layout: ParallelLayout, model: ModelConfig, cfg: RunConfig) -> None:
    layout.check_model(
        num_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        num_experts=model.num_experts if model.is_moe else None,
    )
    layout.check_sequence_length(cfg.engine.max_sequence_length)


def missing_inputs(cfg: RunConfig) -> list[str]:
    """What the run needs from outside that is not here: input files named by the config that
    do not exist, and what the rollout backend needs (SGLang servers, when none are given)."""
    from pathlib import Path

    out = []
    model = cfg.model
    for key, value in (
        ("model.init_from", model.init_from),
        ("model.tokenizer", model.tokenizer),
        ("critic.init_from", cfg.critic.init_from),
        ("reward.model_path", cfg.reward.model_path),
    ):
        if value and value not in CHAR_TOKENIZER_NAMES and not Path(value).exists():
            out.append(f"{key}={value} does not exist")
    for key in ("train_files", "eval_files"):
        for path in getattr(cfg.data, key, None) or []:
            if not Path(path).exists():
                out.append(f"data.{key} entry {path} does not exist")
    for name, bench in cfg.eval.benchmarks.items():
        for path in bench.files:
            if not Path(path).exists():
                out.append(f"eval.benchmarks.{name}.files entry {path} does not exist")
    return out + rollout_backend(cfg.rollout.engine).missing_inputs(cfg)


def _check(cfg: RunConfig, model: ModelConfig, layout: ParallelLayout) -> None:
    from gspo_megatron.algorithms.losses import POLICY_LOSSES

    alg, rollout, trainer, optimizer = cfg.algorithm, cfg.rollout, cfg.trainer, cfg.optimizer
    if alg.loss not in POLICY_LOSSES:
        raise ConfigError(f"algorithm.loss={alg.loss!r} is not one of {sorted(POLICY_LOSSES)}")
    try:
        POLICY_LOSSES[alg.loss].resolve_hparams(alg.loss_hparams(rollout.max_new_tokens))
    except ValueError as err:
        raise ConfigError(f"algorithm.hparams: {err}") from err
    samples = rollout.prompts_per_step * rollout.group_size
    if samples % alg.num_minibatches:
        raise ConfigError(
            f"rollout.prompts_per_step*group_size = {samples} responses must split evenly into "
            f"algorithm.num_minibatches={alg.num_minibatches}"
        )
    if samples // alg.num_minibatches < layout.dp:
        raise ConfigError(
            f"each minibatch has {samples // alg.num_minibatches} responses, fewer than the "
            f"{layout.dp} data-parallel ranks"
        )
    if alg.routing_replay != "off" and not model.is_moe:
        raise ConfigError("algorithm.routing_replay needs a Mixture-of-Experts model")
    engine = cfg.engine
    if engine.max_tokens_per_microbatch < engine.max_sequence_length:
        raise ConfigError(
            f"engine.max_tokens_per_microbatch={engine.max_tokens_per_microbatch} is below "
            f"engine.max_sequence_length={engine.max_sequence_length}: a sequence of that length "
            "would not fit a micro-batch"
        )
    if optimizer.min_lr > optimizer.lr:
        raise ConfigError(
            f"optimizer.min_lr={optimizer.min_lr:g} must not exceed optimizer.lr={optimizer.lr:g}"
        )
    if alg.mismatch_lower >= alg.mismatch_upper:
        raise ConfigError(
            f"algorithm.mismatch_lower={alg.mismatch_lower:g} must be below "
            f"algorithm.mismatch_upper={alg.mismatch_upper:g}"
        )
    _check_mismatch(alg)
    _check_task_labels(cfg)
    _check_room_for_the_end_token(cfg)
    _check_critic(cfg)
    _check_credit(cfg)
    _check_lora(cfg, model)
    _check_moe_aux_loss(alg, model)
    _check_rollout_mode(cfg)
    _check_export(cfg, model)
    _check_clip_scale(cfg)
    _check_stability(cfg, model)
    rollout_backend(rollout.engine).check(cfg)
    _check_resume(trainer.resume)
    if alg.overlong_penalty_length and not 0 < alg.overlong_penalty_cache <= (
        alg.overlong_penalty_length
    ):
        raise ConfigError(
            "algorithm.overlong_penalty_cache must be in (0, algorithm.overlong_penalty_length]"
        )


def _check_task_labels(cfg: RunConfig) -> None:
    """A synthetic task's labels go with the reward that reads them: code problems (expr) with
    reward=code, answer strings with the others."""
    task, reward = cfg.data.task, cfg.reward.name
    if task is None:
        return
    from gspo_megatron.rewards.synthetic import CODE_TASKS

    if task in CODE_TASKS and reward in ("synthetic", "math", "exact_match", "format"):
        raise ConfigError(
            f"data.task={task} labels are code problems, which reward.name={reward} cannot "
            "score: set reward=code (or reward.name=remote against a sandbox service)"
        )
    if task not in CODE_TASKS and reward == "code":
        raise ConfigError(
            f"reward.name=code runs programs on a label's tests; data.task={task}'s labels are "
            f"answer strings: use reward=synthetic, or data.task one of {sorted(CODE_TASKS)}"
        )


def _check_room_for_the_end_token(cfg: RunConfig) -> None:
    """The synthetic reward, and the code reward on a synthetic code task (expr), give full
    credit only to the answer followed by the end token: a response that never stops must be
    longer than every target, so it cannot score 1."""
    task, reward = cfg.data.task, cfg.reward.name
    if task is None or reward not in ("synthetic", "code"):
        return
    from gspo_megatron.data.config import synthetic_task

    longest = synthetic_task(cfg.data).max_target_chars()
    limits = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens}
    if cfg.eval.heldout.max_new_tokens is not None:
        limits["eval.heldout.max_new_tokens"] = cfg.eval.heldout.max_new_tokens
    for key, limit in limits.items():
        if limit <= longest:
            raise ConfigError(
                f"{key}={limit} leaves no room for the end token after data.task="
                f"{task}'s longest answer ({longest} characters): the {reward} reward "
                f"gives full credit only to the answer followed by the end token; set {key} >= "
                f"{longest + 1}"
            )


def _check_rollout_mode(cfg: RunConfig) -> None:
    rollout, mode = cfg.rollout, cfg.rollout.mode
    if mode != "async" and rollout.pin_versions:
        raise ConfigError(
            f"rollout.pin_versions with rollout.mode={mode}: only async mode takes new weights "
            "between tokens (one_step_off always samples a batch with one version; sync has no "
            "batches ahead)"
        )
    if rollout.pin_versions and rollout.partial_rollout_mask:
        raise ConfigError(
            "rollout.partial_rollout_mask with rollout.pin_versions: a pinned batch never takes "
            "new weights within a response, so there is nothing to mask"
        )
    if mode == "sync":
        if rollout.partial_rollout_mask:
            raise ConfigError(
                "rollout.partial_rollout_mask needs rollout.mode=async (only async mode swaps "
                "weights within a response)"
            )
        return
    if mode == "one_step_off" and rollout.partial_rollout_mask:
        raise ConfigError(
            "rollout.partial_rollout_mask needs rollout.mode=async (one_step_off takes new "
            "weights only between batches)"
        )
    if rollout.max_staleness < 1:
        raise ConfigError(
            f"rollout.mode={mode} needs rollout.max_staleness >= 1: a batch that generates while "
            "the previous one trains is sampled by weights one version old"
        )
    if cfg.trainer.offload_during_rollout != "none":
        raise ConfigError(
            f"trainer.offload_during_rollout={cfg.trainer.offload_during_rollout} with "
            f"rollout.mode={mode}: generation overlaps training, so the training state cannot "
            "leave while it runs"
        )
    if cfg.algorithm.dynamic_sampling == "dapo":
        raise ConfigError(
            f"algorithm.dynamic_sampling=dapo with rollout.mode={mode}: its refill rounds need "
            "the step's rewards first (a synchronous round trip each) and would draw prompts "
            "out of order with the batches generated ahead; use dupo or none"
        )


def _check_export(cfg: RunConfig, model: ModelConfig) -> None:
    """An HF export needs a mapping of the architecture (the tokenizer is checked once loaded:
    components.build_trainer)."""
    if not cfg.trainer.export_hf_every:
        return
    from gspo_megatron.checkpoint.mapping import ConversionError, get_mapping

    try:
        get_mapping(model)
    except ConversionError as err:
        raise ConfigError(
            f"trainer.export_hf_every={cfg.trainer.export_hf_every}: the model has no Hugging "
            f"Face export ({err}); set trainer.export_hf_every=0"
        ) from err


def _check_critic(cfg: RunConfig) -> None:
    from gspo_megatron.algorithms.losses import POLICY_LOSSES

    alg, critic = cfg.algorithm, cfg.critic
    if alg.advantage != "gae":
        defaults = AlgorithmSection()
        unused = [
            f"algorithm.{name}"
            for name in ("gamma", "lam", "kl_reward_coef")
            if getattr(alg, name) != getattr(defaults, name)
        ]
        unused += _changed_keys(critic, "critic")
        if unused:
            raise ConfigError(
                f"{unused[0]} is set but only PPO's advantage estimation reads it: set "
                "algorithm.advantage=gae (a critic) or leave it at its default"
            )
        return
    if POLICY_LOSSES[alg.loss].sequence_advantages:
        raise ConfigError(
            f"algorithm.advantage=gae gives every token its own advantage; algorithm.loss="
            f"{alg.loss} takes one advantage per sequence (use ppo, grpo, dapo, dr_grpo, sapo, "
            "cispo or gspo_token)"
        )
    if critic.warmup_steps >= cfg.trainer.steps:
        raise ConfigError(
            f"critic.warmup_steps={critic.warmup_steps} leaves no step of trainer.steps="
            f"{cfg.trainer.steps} that trains the policy"
        )
    if critic.optimizer.min_lr > critic.optimizer.lr:
        raise ConfigError(
            f"critic.optimizer.min_lr={critic.optimizer.min_lr:g} must not exceed "
            f"critic.optimizer.lr={critic.optimizer.lr:g}"
        )


def _check_credit(cfg: RunConfig) -> None:
    """Per-turn credit: multi-turn episodes, a loss with token advantages, one discount."""
    from gspo_megatron.algorithms.losses import POLICY_LOSSES

    alg = cfg.algorithm
    if alg.credit == "episode":
        if alg.turn_gamma != AlgorithmSection.turn_gamma:
            raise ConfigError(
                f"algorithm.turn_gamma={alg.turn_gamma:g} is set but only algorithm.credit=turn "
                "reads it"
            )
        return
    if not cfg.env.enabled:
        raise ConfigError(
            "algorithm.credit=turn needs multi-turn episodes (env.name): a single-turn response "
            "has one turn, whose credit is the episode's"
        )
    if POLICY_LOSSES[alg.loss].sequence_advantages:
        raise ConfigError(
            f"algorithm.credit=turn gives the turns of an episode different advantages; "
            f"algorithm.loss={alg.loss} multiplies its sequence-level ratio by one advantage "
            "per sequence (use gspo_token: GSPO's sequence ratio with each token's own "
            "advantage; or grpo, dapo, dr_grpo, sapo, cispo, ppo)"
        )
    if alg.advantage == "gae" and alg.turn_gamma != AlgorithmSection.turn_gamma:
        raise ConfigError(
            f"algorithm.turn_gamma={alg.turn_gamma:g} with algorithm.advantage=gae: GAE "
            "discounts per token with algorithm.gamma (each turn's reward lands on its last "
            "token); leave turn_gamma at 1"
        )


def _changed_keys(section: Any, prefix: str) -> list[str]:
    """The key paths of a section's fields set away from their defaults."""
    default = type(section)()
    return [
        f"{prefix}.{f.name}"
        for f in dataclasses.fields(section)
        if getattr(section, f.name) != getattr(default, f.name)
    ]


def _check_lora(cfg: RunConfig, model: ModelConfig) -> None:
    """LoRA's keys, and what LoRA does not do yet refused by name (docs/LORA.md)."""
    lora = cfg.lora
    if not lora.enabled:
        unused = _changed_keys(lora, "lora")
        if unused:
            raise ConfigError(
                f"{unused[0]} is set but LoRA is off (lora.rank=null): set lora.rank to train "
                "adapters"
            )
        return
    try:
        resolve_targets(lora.targets, model.is_moe)
        resolve_modules_to_save(lora.modules_to_save, model.tie_word_embeddings)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    kl = cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_reward_coef > 0
    not_yet = [
        (
            kl and bool(lora.modules_to_save),
            f"lora.modules_to_save={lora.modules_to_save} and a KL penalty "
            "(algorithm.kl_coef / kl_reward_coef): the KL reference is the base model with the "
            "adapters off, which is not the initial policy once whole weights train too",
        ),
        (
            lora.dropout > 0,
            f"lora.dropout={lora.dropout:g}: dropout would make the trained forward a random "
            "perturbation of the policy that sampled and computed the old log-probs, so the "
            "importance ratio is not 1 even before the first update (the sequence ratio's clip "
            "range is ~1e-3 wide); set lora.dropout=0",
        ),
        (
            cfg.engine.use_te is True,
            "engine.use_te=true: LoRA adapts megatron's local layers, not transformer-engine's",
        ),
        (
            not rollout_backend(cfg.rollout.engine).generates_with_adapters,
            f"rollout.engine={cfg.rollout.engine}: the backend does not generate with a LoRA "
            "policy's adapters (its registry entry, rollout/backends.py); use "
            "rollout.engine=embedded or sglang",
        ),
        (
            cfg.algorithm.advantage == "gae"
            and _critic_has_own_layout(cfg)
            and not (cfg.critic.init_from or cfg.model.init_from),
            "algorithm.advantage=gae, a critic.parallel layout of its own and neither "
            "critic.init_from nor model.init_from: the critic (full-parameter) would start from "
            "a scratch checkpoint of the policy, whose adapters a value model cannot load; set "
            "critic.init_from or model.init_from, or leave critic.parallel at the policy's layout",
        ),
    ]
    for refused, reason in not_yet:
        if refused:
            raise ConfigError(f"lora.rank={lora.rank} with {reason} (docs/LORA.md)")


def _critic_has_own_layout(cfg: RunConfig) -> bool:
    """critic.parallel sets a key to other than the policy's value (its own process groups)."""
    return any(
        value is not None and value != getattr(cfg.parallel, name)
        for name, value in dataclasses.asdict(cfg.critic.parallel).items()
    )


def _check_clip_scale(cfg: RunConfig) -> None:
    """A clip range at the other scale than the ratio the loss clips (docs/STABILITY.md,
    "Guardrails"), unless stability.allow_clip_scale_mismatch says so."""
    from gspo_megatron.algorithms.losses import clip_scale_problem

    alg = cfg.algorithm
    problem = clip_scale_problem(alg.loss, alg.loss_hparams(cfg.rollout.max_new_tokens))
    if problem and not cfg.stability.allow_clip_scale_mismatch:
        key, why = problem
        raise ConfigError(
            f"algorithm.hparams.{key}={why}. Set the loss's range, or "
            "stability.allow_clip_scale_mismatch=true to run it anyway"
        )


def _check_stability(cfg: RunConfig, model: ModelConfig) -> None:
    """The mismatch budget and the sentinel against what the run measures and can change."""
    budget, sentinel, alg = cfg.stability.mismatch_budget, cfg.stability.sentinel, cfg.algorithm
    prefix = "stability.mismatch_budget"
    if budget.k3_kl and alg.old_logprobs == "rollout":
        raise ConfigError(
            f"{prefix}.k3_kl compares the rollout's log-probs with the trainer's old-policy "
            "forward, which algorithm.old_logprobs=rollout does not run: use "
            "algorithm.old_logprobs=recompute"
        )
    if budget.route_flips:
        _check_route_flips_measured(cfg, model, f"{prefix}.route_flips")
    if budget.remedy != "warn" and not (budget.k3_kl or budget.route_flips):
        raise ConfigError(
            f"{prefix}.remedy={budget.remedy} has no budget to act on: set {prefix}.k3_kl or "
            f"{prefix}.route_flips"
        )
    if budget.remedy == "mis":
        if alg.old_logprobs == "rollout":
            raise ConfigError(
                f"{prefix}.remedy=mis needs the trainer's own old log-probs to compare with the "
                "rollout's: set algorithm.old_logprobs=recompute"
            )
        if alg.mismatch != "none":
            raise ConfigError(
                f"{prefix}.remedy=mis with algorithm.mismatch={alg.mismatch}: a correction is "
                "already on; use remedy warn, or algorithm.mismatch=none"
            )
        _check_mismatch(dataclasses.replace(alg, mismatch="mis"), f"{prefix}.remedy")
    if budget.remedy == "lower_staleness":
        if cfg.rollout.mode == "sync":
            raise ConfigError(
                f"{prefix}.remedy=lower_staleness with rollout.mode=sync: synchronous rollouts "
                "are never stale; use one_step_off or async, or another remedy"
            )
        if cfg.rollout.max_staleness < 2:
            raise ConfigError(
                f"{prefix}.remedy=lower_staleness with rollout.max_staleness="
                f"{cfg.rollout.max_staleness}: it is already the least rollout.mode="
                f"{cfg.rollout.mode} allows"
            )
    if sentinel.on_mismatch_budget and not (budget.k3_kl or budget.route_flips):
        raise ConfigError(
            f"stability.sentinel.on_mismatch_budget needs a budget: set {prefix}.k3_kl or "
            f"{prefix}.route_flips"
        )
    if sentinel.entropy_fraction and not cfg.engine.entropy_metric:
        raise ConfigError(
            "stability.sentinel.entropy_fraction watches actor/entropy, which "
            "engine.entropy_metric=false turns off: set stability.sentinel.entropy_fraction=0 "
            "or engine.entropy_metric=true"
        )
    defaults = SentinelSection()
    if not sentinel.lowers_lr:
        for name in ("lr_factor", "lr_steps"):
            if getattr(sentinel, name) != getattr(defaults, name):
                raise ConfigError(
                    f"stability.sentinel.{name} is set but stability.sentinel.remedy="
                    f"{sentinel.remedy} does not lower the learning rate"
                )
    trainer = cfg.trainer
    if sentinel.enabled and not (trainer.save_every or trainer.save_every_minutes):
        raise ConfigError(
            "stability.sentinel.enabled rolls back to checkpoints, and trainer.save_every=0 with "
            "trainer.save_every_minutes=0 saves none before the end: set one, or "
            "stability.sentinel.enabled=false"
        )


def _check_route_flips_measured(cfg: RunConfig, model: ModelConfig, key: str) -> None:
    """moe/route_flips needs a MoE policy, the rollout's routes and the trainer's own."""
    alg = cfg.algorithm
    if not model.is_moe:
        raise ConfigError(f"{key} needs a Mixture-of-Experts model")
    if alg.routing_replay == "r3":
        raise ConfigError(
            f"{key} with algorithm.routing_replay=r3: the trainer routes with the rollout's "
            "experts, so no route differs (moe/route_flips is 0); budget mismatch/k3_kl instead"
        )
    backend = rollout_backend(cfg.rollout.engine)
    if not backend.records_routes(cfg):
        raise ConfigError(f"{key} needs the rollout engine's routes: set {backend.route_setting}")
    if alg.routing_replay != "r2" and not (
        alg.old_logprobs == "recompute" and cfg.logging.moe_route_metrics
    ):
        raise ConfigError(
            f"{key} needs the trainer's routes from the old-policy forward: set "
            "algorithm.old_logprobs=recompute with logging.moe_route_metrics=true, or "
            "algorithm.routing_replay=r2"
        )


def _check_mismatch(alg: AlgorithmSection, key: str = "algorithm.mismatch") -> None:
    from gspo_megatron.algorithms.mismatch import mismatch_support

    if alg.mismatch != "none" and alg.old_logprobs == "rollout":
        raise ConfigError(
            f"algorithm.mismatch={alg.mismatch} needs algorithm.old_logprobs=recompute: with "
            "the rollout's log-probs as pi_old there is no train/rollout mismatch to correct"
        )
    problem = mismatch_support(alg.loss, alg.mismatch, alg.mismatch_level)
    if problem:
        what = f"algorithm.mismatch={alg.mismatch}"
        if key != "algorithm.mismatch":
            what = f"{key}={alg.mismatch} would turn on algorithm.mismatch={alg.mismatch}"
        raise ConfigError(
            f"{what} at algorithm.mismatch_level="
            f"{alg.mismatch_level} with algorithm.loss={alg.loss}: {problem}"
        )


def _check_moe_aux_loss(alg: AlgorithmSection, model: ModelConfig) -> None:
    if alg.moe_aux_loss == "none" and alg.moe_aux_loss_coef:
        raise ConfigError(
            f"algorithm.moe_aux_loss_coef={alg.moe_aux_loss_coef:g} with algorithm.moe_aux_loss="
            "none: choose a load-balancing loss (aux_loss, seq_aux_loss, global_aux_loss)"
        )
    if alg.moe_aux_loss != "none" and not alg.moe_aux_loss_coef:
        raise ConfigError(
            f"algorithm.moe_aux_loss={alg.moe_aux_loss} needs algorithm.moe_aux_loss_coef > 0"
        )
    if alg.moe_aux_loss != "none" and not model.is_moe:
        raise ConfigError("algorithm.moe_aux_loss needs a Mixture-of-Experts model")


def _check_resume(resume: str) -> None:
    if resume in ("auto", "never"):
        return
    from pathlib import Path

    from gspo_megatron.checkpoint.meta import META_FILE

    path = Path(resume)
    if not (path / META_FILE).is_file():
        what = "does not exist" if not path.exists() else f"has no {META_FILE}"
        raise ConfigError(
            f"trainer.resume={resume!r} is not auto, never, or a checkpoint directory "
            f"({path} {what})"
        )


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    model = out.pop("model")
    out["model"] = {**model.pop("architecture"), **model}
    return out


def _build(cls, raw: Any, path: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"unknown config key {where}")
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in raw:
            raise ConfigError(f"{path}.{f.name} is required" if path else f"{f.name} is required")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        key = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hint) and name != "model":
            values[name] = _build(hint, value, key)
        elif name == "model":
            continue
        else:
            values[name] = _coerce(value, hint, key)
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args or hint is Any:
            return None
        raise ConfigError(f"{key} must not be null")
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        if args and dataclasses.is_dataclass(args[0]):
            return [_build(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
        return list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        if args and dataclasses.is_dataclass(args[1]):
            return {k: _build(args[1], v, f"{key}.{k}") for k, v in value.items()}
        return dict(value)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if base is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if base is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if base is float:
        return float(value)
    if base is str and not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value
