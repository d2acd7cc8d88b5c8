"""The embedded backend (`rollout.engine=embedded`, the default): generation from the policy's own
weights. With rollout.mode=sync it runs in the trainer's processes (in_process.EmbeddedEngine,
an InProcessRolloutEngine); with one_step_off / async in a generator process of its own on rank
0 (generator.GeneratorProcessEngine, a ServerRolloutEngine), fed the policy's weights after each
step. Registered in rollout/backends.py; it imports its engines when it builds one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from gspo_megatron.config_fields import ConfigError
from gspo_megatron.rollout.backends import RolloutBackend, RolloutShare, RunContext

if TYPE_CHECKING:
    from gspo_megatron.config import RolloutSection, RunConfig
    from gspo_megatron.megatron.training_engine import TrainingEngine


def build(cfg: RunConfig, policy: TrainingEngine, run: RunContext):
    """The engine over the policy, and the weight source of the generator process (None in
    process: it reads the policy's parameters)."""
    record_routes = records_routes(cfg)
    if cfg.rollout.mode != "sync":
        return build_generator_process(cfg, policy, record_routes)
    from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine

    engine = EmbeddedEngine(
        policy,
        max_batch_tokens=cfg.rollout.max_batch_tokens,
        record_routes=record_routes,
        seed=cfg.seed,
        prefix_cache_tokens=kept_context_tokens(cfg),
    )
    return engine, None


def build_generator_process(cfg: RunConfig, policy: TrainingEngine, record_routes: bool):
    """The embedded engine's asynchronous form (rollout.mode one_step_off / async) and the
    weight source it copies from; rank 0 starts the process. A LoRA policy's source is its
    base and its adapters (megatron/lora_sync.py), merged in the process."""
    from gspo_megatron.megatron.lora_sync import LoRAWeightSource
    from gspo_megatron.megatron.weight_export import MegatronWeightSource
    from gspo_megatron.rollout.embedded.generator import GeneratorProcessEngine

    settings, rope = generator_settings(cfg, policy, record_routes)
    dtype = policy.config.params_dtype
    if policy.lora is not None:
        source = LoRAWeightSource.from_engine(policy)
        shapes = {**source.base.hf_shapes(), **source.adapters.hf_shapes()}
        if source.trained is not None:
            trained = tuple(source.trained.hf_shapes())
            settings = dataclasses.replace(settings, lora_trained=trained)
    else:
        source = MegatronWeightSource.from_engine(policy)
        shapes = source.hf_shapes()
    weights = {name: (shape, dtype) for name, shape in shapes.items()}
    return GeneratorProcessEngine(settings, weights, rope, leader=source.is_sender()), source


def generator_settings(cfg: RunConfig, policy: TrainingEngine, record_routes: bool):
    """The generator process's settings and the trainer's RoPE angles [positions, head dim]."""
    import torch

    from gspo_megatron.device import accelerator
    from gspo_megatron.rollout.embedded.decoders import (
        decoder_spec,
        torch_decoder_math_unsupported,
    )
    from gspo_megatron.rollout.embedded.generator import GeneratorSettings

    model = policy.unwrapped_chunks[0]
    reason = torch_decoder_math_unsupported(model, policy.config)
    if reason is not None:
        raise ConfigError(
            f"rollout.mode={cfg.rollout.mode}: the generator process cannot run this model "
            f"({reason})"
        )
    model_config = policy.model_config
    max_length = min(cfg.engine.max_sequence_length, model_config.max_position_embeddings)
    settings = GeneratorSettings(
        model=model_config,
        spec=decoder_spec(model, policy.config, model_config.vocab_size),
        max_batch_tokens=cfg.rollout.max_batch_tokens,
        max_sequence_length=max_length,
        record_routes=record_routes,
        route_shape=(policy.config.num_layers, policy.config.moe_router_topk or 0),
        partial=cfg.rollout.mode == "async" and not cfg.rollout.pin_versions,
        seed=cfg.seed,
        device=str(accelerator()) if torch.cuda.is_available() else "cpu",
        lora_scaling=policy.lora.scaling if policy.lora is not None else None,
        prefix_cache_tokens=kept_context_tokens(cfg),
    )
    return settings, model.rotary_pos_emb.get_emb(max_length)[:, 0, 0, :].cpu()


def records_routes(cfg: RunConfig) -> bool:
    """Routes are recorded for R3, and for the route metrics (rollout vs trainer route flips)
    of a MoE policy: the router's top-k of every generated token, at no extra forward."""
    if cfg.algorithm.routing_replay == "r3":
        return True
    return cfg.logging.moe_route_metrics and cfg.model.model_config().is_moe


def kept_context_tokens(cfg: RunConfig) -> int:
    """rollout.prefix_cache_tokens when an environment runs episodes (a turn's prompt starts
    with the sequence its last turn finished), else 0: a single-turn call's prompt never starts
    with a finished sequence, so keeping their K/V would cost time and never be reused."""
    return cfg.rollout.prefix_cache_tokens if cfg.env.enabled else 0


def memory_share(rollout: RolloutSection) -> RolloutShare:
    """A KV cache of rollout.max_batch_tokens slots while generating, and the context kept
    between calls (rollout.prefix_cache_tokens, kept only with an environment, counted
    whether one runs or not): in rollout.mode=sync both freed before training; the generator
    process (one_step_off / async) keeps its context until the next weight update. In sync
    mode a LoRA policy's torch decoder merges the adapted weights into a copy per batch; the
    generator process merges into the weights it holds anyway."""
    return RolloutShare(
        kv_cache_tokens=rollout.max_batch_tokens,
        kept_kv_tokens=rollout.prefix_cache_tokens,
        merges_adapters_per_batch=rollout.mode == "sync",
    )


EMBEDDED = RolloutBackend(
    build=build,
    memory_share=memory_share,
    keeps_policy_weights=True,
    records_routes=records_routes,
    route_setting="logging.moe_route_metrics=true",
    generates_with_adapters=True,
)
