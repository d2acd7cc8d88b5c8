"""How the training engine runs: the `optimizer` and `engine` config sections, used by
`gspo_megatron.megatron.training_engine.TrainingEngine` as they are."""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.config_fields import bounded, choice

# Size of one float32 [chunk tokens x local vocabulary] buffer of the log-prob computation
# (gspo_megatron/megatron/logprobs.py); a chunk needs about three.
DEFAULT_LOGPROB_CHUNK_BYTES = 8 * 2**20


@dataclass
class OptimizerSettings:
    """`optimizer`: Adam (or SGD) with megatron's distributed optimizer, gradient clipping and a
    learning-rate schedule over the run's optimizer steps (trainer.steps x
    algorithm.num_minibatches; warmup_steps count optimizer steps too).

    decay_style: constant | linear | cosine, from lr down to min_lr.
    distributed_optimizer: shard the optimizer state over data-parallel ranks.
    """

    name: str = choice("adam", "sgd")
    lr: float = bounded(3e-4, ge=0)
    min_lr: float = bounded(0.0, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    adam_eps: float = bounded(1e-8, gt=0)
    clip_grad: float = bounded(1.0, ge=0)
    warmup_steps: int = bounded(0, ge=0)
    decay_style: str = choice("constant", "linear", "cosine")
    distributed_optimizer: bool = True


@dataclass
class EngineSettings:
    """`engine`: batching and numerics of the training engine.

    max_sequence_length: prompt + response tokens; longer samples are an error.
    max_tokens_per_microbatch: tokens per micro-batch, padding included (padded: batch x
    length; packed: the sequences' total).
    pack_sequences: sequences end to end in one row per micro-batch (THD), none computed on
    padding, and micro-batches balanced over data-parallel ranks by token count; false: each
    micro-batch right-padded to its longest sequence.
    nonfinite: skip | raise, for a non-finite loss or gradient (with skip, the run stops after
    trainer.max_consecutive_skipped_steps skipped optimizer steps in a row).
    recompute_activations: full activation recomputation (less memory, ~1/3 more compute).
    entropy_metric: the policy's entropy on the trained tokens as a metric (one pass over the
    vocabulary: in the old-policy forward when there is one, else in each training forward).
    logprob_chunk_bytes: one float32 buffer of the log-prob computation (bounds its memory).
    use_te: transformer-engine layers; null = when importable on a GPU.
    """

    max_sequence_length: int = bounded(64, ge=2)
    max_tokens_per_microbatch: int = bounded(4096, ge=1)
    pack_sequences: bool = True
    nonfinite: str = choice("skip", "raise")
    recompute_activations: bool = False
    entropy_metric: bool = True
    logprob_chunk_bytes: int = bounded(DEFAULT_LOGPROB_CHUNK_BYTES, ge=1)
    use_te: bool | None = None
