"""The SGLang backend (`rollout.engine=sglang`): SGLang servers, launched by rank 0 or attached
to, driven from rank 0 (engine.SGLangEngine, a ServerRolloutEngine), weights sent after each
step (tensor / distributed / disk; a LoRA policy's merged, or its adapters alone through
SGLang's LoRA API: rollout.sglang.lora_sync). Its settings are the `rollout.sglang` section
(config.py).
Registered in rollout/backends.py; it imports the engine when it builds one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gspo_megatron.config_fields import ConfigError
from gspo_megatron.rollout.backends import RolloutBackend, RolloutShare, RunContext
from gspo_megatron.spec.lora import EXPERT_TARGETS, resolve_targets

if TYPE_CHECKING:
    from gspo_megatron.config import RolloutSection, RunConfig
    from gspo_megatron.megatron.training_engine import TrainingEngine

# SGLang's own default when mem_fraction_static is not set (it takes most of the GPU).
SGLANG_DEFAULT_MEM_FRACTION = 0.88
# What an offloaded server keeps while the trainer trains (CUDA context, graphs' pools).
OFFLOADED_SERVER_GIB = 2.0


def build(cfg: RunConfig, policy: TrainingEngine, run: RunContext):
    """The engine (rank 0, the weights' sender, launches and drives the servers:
    rollout/driver.py) and the policy's weights as HF-named buckets (a LoRA policy's merged,
    or with rollout.sglang.lora_sync=adapter its adapters, PEFT-named). The leader records the
    servers' released memory in the run directory (docs/SGLANG.md, "Server memory")."""
    from gspo_megatron.megatron.lora_sync import LoRAAdapterSource, LoRAWeightSource
    from gspo_megatron.megatron.weight_export import MegatronWeightSource
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.rollout.sglang.memory import RECORD_FILE
    from gspo_megatron.rollout.sglang.updates.adapter import LoRAServing

    lora = None
    if policy.lora is not None and cfg.rollout.sglang.lora_sync == "adapter":
        source = LoRAAdapterSource.from_engine(policy)
        lora = LoRAServing.of(source.peft_config)
    elif policy.lora is not None:
        source = LoRAWeightSource.from_engine(policy)
    else:
        source = MegatronWeightSource.from_engine(policy)
    engine = SGLangEngine(
        cfg.rollout.sglang,
        leader=source.is_sender(),
        partial_rollouts=cfg.rollout.mode == "async",
        memory_record=Path(run.run_dir) / RECORD_FILE,
        announce=run.announce,
        lora=lora,
    )
    return engine, source


def check_run_dir(cfg: RunConfig, run_dir: Path) -> None:
    """A damaged memory record (rollout/sglang/memory.py) stops the run before the model is
    built."""
    from gspo_megatron.rollout.sglang.memory import RECORD_FILE, MemoryRecord

    MemoryRecord(Path(run_dir) / RECORD_FILE).read()


def check(cfg: RunConfig) -> None:
    """The section's keys (servers aside: `missing_inputs`) and what SGLang cannot do with the
    rest of the run."""
    sglang, mode = cfg.rollout.sglang, cfg.rollout.mode
    try:
        sglang.validate(servers=False)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if cfg.algorithm.routing_replay == "r3" and not sglang.return_routed_experts:
        raise ConfigError(
            "algorithm.routing_replay=r3 with SGLang needs "
            "rollout.sglang.return_routed_experts=true"
        )
    if mode != "sync" and sglang.weight_sync == "tensor":
        raise ConfigError(
            f"rollout.sglang.weight_sync=tensor with rollout.mode={mode}: tensor mode is for "
            "servers colocated with the trainer on its GPUs, where generation and training take "
            "turns; overlapping them needs servers of their own (weight_sync=distributed or disk)"
        )
    if cfg.rollout.pin_versions:
        raise ConfigError(
            "rollout.pin_versions with rollout.engine=sglang: pinning makes the embedded "
            "engine's runs deterministic; servers are not (their batching changes the numbers), "
            "and a server holds only its newest weights. Leave it false (one_step_off waits for "
            "the requests running before each update: one version per batch)"
        )
    if sglang.lora_sync == "adapter":
        if not cfg.lora.enabled:
            raise ConfigError(
                "rollout.sglang.lora_sync=adapter with lora.rank=null: there are no adapters to "
                "sync (the key chooses how a LoRA policy's weights reach the servers)"
            )
        _check_adapter_sync(cfg)
    if mode != "sync" and sglang.offload_after_generate:
        raise ConfigError(
            f"rollout.sglang.offload_after_generate with rollout.mode={mode}: batches generate "
            "while others are queued, so the servers' memory cannot leave after each one"
        )


def _check_adapter_sync(cfg: RunConfig) -> None:
    """What SGLang 0.5.23's LoRA API cannot take (docs/LORA.md, "Weight sync")."""
    sglang, key = cfg.rollout.sglang, "rollout.sglang.lora_sync=adapter"
    if sglang.weight_sync != "disk":
        raise ConfigError(
            f"{key} with rollout.sglang.weight_sync={sglang.weight_sync}: the adapters reach "
            "the servers as a PEFT directory per version under rollout.sglang.disk_dir, which "
            "they load by path (/load_lora_adapter); set weight_sync=disk and disk_dir to a "
            "directory every server can read"
        )
    if cfg.lora.modules_to_save:
        raise ConfigError(
            f"{key} with lora.modules_to_save={cfg.lora.modules_to_save}: SGLang's LoRA API "
            "loads lora_A/lora_B pairs onto the base it was started from; a whole trained "
            "weight cannot go through it. Use lora_sync=merged"
        )
    for i, lc in enumerate(sglang.launch):
        if lc.dp_size != 1:
            raise ConfigError(
                f"rollout.sglang.launch[{i}].dp_size={lc.dp_size} with {key}: SGLang refuses "
                "dynamic LoRA loading with data-parallel replicas (dp_size > 1); launch one "
                "server per replica with dp_size=1"
            )
    # expert adapters are named in PEFT's adapter_config.json by target_parameters, which
    # SGLang 0.5.23's LoRA loader does not read (it sizes and matches by target_modules)
    is_moe = cfg.model.model_config().is_moe
    experts = sorted(resolve_targets(cfg.lora.targets, is_moe) & set(EXPERT_TARGETS))
    if experts:
        raise ConfigError(
            f"{key} with lora.targets={cfg.lora.targets}, which adapts {', '.join(experts)}: "
            "the PEFT adapter names expert adapters by target_parameters, which SGLang "
            "0.5.23's LoRA loader does not read; target attention only "
            "(lora.targets=[attention.linear_qkv,attention.linear_proj]) or use "
            "lora_sync=merged (docs/LORA.md)"
        )


def missing_inputs(cfg: RunConfig) -> list[str]:
    """No server to attach to and none to launch (a preset may leave them to the launch
    script: slurm/train_disaggregated.sbatch)."""
    sglang = cfg.rollout.sglang
    if sglang.urls or sglang.launch:
        return []
    return [
        "rollout.sglang.urls: give server URLs to attach to (or servers to launch: "
        "rollout.sglang.launch)"
    ]


def memory_share(rollout: RolloutSection) -> RolloutShare:
    """Launched servers are colocated with the trainer (their mem_fraction_static of each GPU);
    attached ones run on GPUs of their own (disaggregated) and cost the trainer nothing."""
    sglang = rollout.sglang
    if not sglang.launch:
        return RolloutShare()
    fractions = [lc.mem_fraction_static or SGLANG_DEFAULT_MEM_FRACTION for lc in sglang.launch]
    return RolloutShare(
        server_fraction=max(fractions),
        server_idle_gib=OFFLOADED_SERVER_GIB if sglang.offload_after_generate else None,
        fraction_key="rollout.sglang.launch[i].mem_fraction_static, with offload_after_generate",
    )


def describe(cfg: RunConfig) -> str:
    return f"rollout: SGLang servers {cfg.rollout.sglang.urls or 'launched'}"


SGLANG = RolloutBackend(
    build=build,
    memory_share=memory_share,
    keeps_policy_weights=False,
    check=check,
    check_run_dir=check_run_dir,
    missing_inputs=missing_inputs,
    describe=describe,
    records_routes=lambda cfg: cfg.rollout.sglang.return_routed_experts,
    route_setting="rollout.sglang.return_routed_experts=true",
    generates_with_adapters=True,  # merged into its weights, or loaded (rollout.sglang.lora_sync)
)
