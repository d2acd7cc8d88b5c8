"""Build the trainer's parts from a validated config: process groups, policy engine (and a frozen
reference for KL), tokenizer, data, reward scorer, rollout engine and weight sync."""

from __future__ import annotations

from pathlib import Path

from gspo_megatron.config import ConfigError, RunConfig
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.model_config import ModelConfig


def build_trainer(cfg: RunConfig, model: ModelConfig, layout: ParallelLayout, run_dir: Path):
    from gspo_megatron.data.config import build_datasets
    from gspo_megatron.data.vocab import check_prompt_ids, check_vocab
    from gspo_megatron.evaluation.benchmarks import build_benchmarks
    from gspo_megatron.megatron import parallel
    from gspo_megatron.peers import PeerWatchdog
    from gspo_megatron.ranks import ProcessGroupRanks
    from gspo_megatron.rewards.registry import build_scorer
    from gspo_megatron.rollout.backends import rollout_backend
    from gspo_megatron.run_files import MetricsLogger, RunCheckpoints
    from gspo_megatron.trainer import Trainer

    tokenizer = load_run_tokenizer(cfg)
    check_vocab(tokenizer, model.vocab_size)
    if cfg.trainer.export_hf_every:
        from gspo_megatron.megatron.hf_export import check_exportable

        check_exportable(model, tokenizer)
    if cfg.reward.model_path:
        check_reward_model(cfg.reward.model_path, tokenizer)
    if cfg.critic.init_from:
        check_value_model(cfg.critic.init_from, model, "critic.init_from")
    train_data, eval_data = build_datasets(cfg.data, tokenizer)
    check_prompt_ids(train_data, model.vocab_size)
    longest_prompt = max(len(p.prompt_ids) for p in train_data.prompts)
    if longest_prompt + cfg.rollout.max_new_tokens > cfg.engine.max_sequence_length:
        raise ConfigError(
            f"the longest prompt ({longest_prompt} tokens) plus rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} exceeds engine.max_sequence_length="
            f"{cfg.engine.max_sequence_length}"
        )
    scorer = build_scorer(cfg.reward)
    benchmarks = build_benchmarks(
        cfg, tokenizer, eval_data, scorer, vocab_size=model.vocab_size, seed=cfg.seed
    )
    _warn_about_memory(cfg, model, layout)
    # the rollout backend's files in the run directory (SGLang's memory record), before the
    # model is built
    rollout_backend(cfg.rollout.engine).check_run_dir(cfg, run_dir)
    parallel.initialize(layout, seed=cfg.seed)
    engine = build_policy_engine(cfg, model, layout)
    reference = None
    kl_to_initial_policy = cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_reward_coef > 0
    if kl_to_initial_policy and cfg.lora.enabled:
        from gspo_megatron.megatron.lora import BaseModelReference

        # LoRA: the policy's base model, adapters off (its weights never train).
        reference = BaseModelReference(engine)
    elif kl_to_initial_policy:
        from gspo_megatron.megatron.training_engine import TrainingEngine

        # The initial policy, frozen: copied before a resume loads the policy's checkpoint, so a
        # resumed run keeps the same reference (model.init_from, or the seeded initialisation).
        reference = TrainingEngine.frozen_copy(engine)
    critic = build_critic(cfg, engine, run_dir) if cfg.algorithm.advantage == "gae" else None
    reward_model = None
    if cfg.reward.model_path:
        from gspo_megatron.megatron.reward_model import RewardModel

        reward_model = RewardModel.load(
            cfg.reward.model_path, layout, cfg.engine, params_dtype=model.params_dtype
        )
    rollout, weight_source = build_rollout(cfg, engine, run_dir)
    exporter = build_exporter(cfg, engine, tokenizer) if cfg.trainer.export_hf_every else None
    ranks = ProcessGroupRanks()
    return Trainer(
        cfg,
        engine=engine,
        rollout=rollout,
        scorer=scorer,
        tokenizer=tokenizer,
        train_data=train_data,
        benchmarks=benchmarks,
        ranks=ranks,
        log=MetricsLogger(run_dir, cfg, total_steps=cfg.trainer.steps, enabled=ranks.rank == 0),
        checkpoints=RunCheckpoints(run_dir, keep_last=cfg.trainer.keep_last),
        watchdog=PeerWatchdog(cfg.trainer.peer_timeout_s),
        weight_source=weight_source,
        reference=reference,
        critic=critic,
        reward_model=reward_model,
        exporter=exporter,
    )


def build_exporter(cfg: RunConfig, engine, tokenizer):
    """The checkpoints' Hugging Face export (trainer.export_hf_every), with the original
    config.json's fields when model.init_from has one (an HF directory, or a converted
    checkpoint's hf_files/)."""
    import json

    from gspo_megatron.checkpoint.convert import HF_FILES_DIR
    from gspo_megatron.megatron.hf_export import HFExporter

    base = None
    if cfg.model.init_from:
        for candidate in (Path(cfg.model.init_from), Path(cfg.model.init_from) / HF_FILES_DIR):
            if (candidate / "config.json").is_file():
                base = json.loads((candidate / "config.json").read_text())
                break
    return HFExporter(engine, tokenizer=tokenizer, base_config=base)


def _warn_about_memory(cfg: RunConfig, model: ModelConfig, layout: ParallelLayout) -> None:
    """The Slurm preflight's memory check, as a warning (the plan is an estimate)."""
    import torch

    if not torch.cuda.is_available():
        return
    from gspo_megatron.memory_plan import PlanError, fit_warning
    from gspo_megatron.notes import note

    gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    try:
        warning = fit_warning(cfg, model, layout, gib)
    except PlanError as err:
        warning = f"the memory plan could not be made ({err})"
    if warning:
        note(f"warning: {warning}")


def load_run_tokenizer(cfg: RunConfig):
    from gspo_megatron.data.tokenizer import load_tokenizer

    source = cfg.model.tokenizer or cfg.model.init_from
    if source is None:
        raise ConfigError("model.tokenizer is null and model.init_from gives no HF directory")
    return load_tokenizer(source)


def build_policy_engine(cfg: RunConfig, model: ModelConfig, layout: ParallelLayout):
    from gspo_megatron.megatron.training_engine import TrainingEngine

    engine = TrainingEngine(
        model,
        layout,
        cfg.engine,
        cfg.optimizer,
        decay_steps=cfg.decay_steps,
        moe_aux_loss=cfg.algorithm.moe_aux_loss,
        moe_aux_loss_coef=cfg.algorithm.moe_aux_loss_coef,
        lora=cfg.lora,
        lora_seed=cfg.seed,
    )
    if cfg.model.init_from:
        init_weights(engine, cfg.model.init_from)
    return engine


def check_reward_model(path: str, tokenizer) -> None:
    """reward.model_path before anything is built: a value model (one label) whose vocabulary
    holds every id of the run's tokenizer (it scores the policy's token ids as they are)."""
    from gspo_megatron.checkpoint.meta import CheckpointError
    from gspo_megatron.checkpoint.reading import check_head, read_model_config
    from gspo_megatron.data.vocab import check_vocab

    try:
        config = read_model_config(path)
        check_head(path, config, value_head=True)
        check_vocab(tokenizer, config.vocab_size)
    except (ValueError, CheckpointError) as err:
        raise ConfigError(f"reward.model_path={path}: {err}") from err


def check_value_model(path: str, model: ModelConfig, key: str) -> None:
    """A value model's checkpoint of the policy's architecture (the critic's init_from)."""
    from gspo_megatron.checkpoint.meta import CheckpointError, architecture_difference
    from gspo_megatron.checkpoint.reading import check_head, read_model_config

    try:
        difference = architecture_difference(read_model_config(path).to_dict(), model)
        check_head(path, model, value_head=True)
    except (ValueError, CheckpointError) as err:
        raise ConfigError(
            f"{key}={path}: {err}. A critic starts from the policy's weights when {key} is null"
        ) from err
    if difference:
        raise ConfigError(f"{key}={path}: {difference}")


def build_critic(cfg: RunConfig, policy, run_dir: Path):
    """PPO's value model on critic.parallel's layout (process groups of its own when that is
    not the policy's): from critic.init_from, or the policy's starting weights (taken before a
    resume loads either) with a zero value head. On its own layout, the critic reads those from
    model.init_from, or from the policy's seeded weights saved to a scratch checkpoint in the
    run directory (removed after)."""
    from gspo_megatron.megatron import checkpointing, parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.megatron.weight_loading import load_engine_weights

    layout = cfg.critic_layout(policy.layout.world_size)
    groups = None if layout == policy.layout else parallel.LayoutGroups(layout, seed=cfg.seed)
    critic = TrainingEngine(
        policy.model_config,
        layout,
        cfg.engine,
        cfg.critic.optimizer,
        decay_steps=cfg.decay_steps_of(cfg.critic.optimizer),
        value_head=True,
        groups=groups,
    )
    if cfg.critic.init_from:
        load_engine_weights(critic, cfg.critic.init_from)
    elif groups is None:
        critic.load_trunk_from(policy)
    elif cfg.model.init_from:
        load_engine_weights(critic, cfg.model.init_from, head="init")
    else:
        scratch = run_dir / "critic_init_from_policy"
        checkpointing.remove_scratch(scratch)
        checkpointing.save_engine(policy, scratch, with_optimizer=False)
        load_engine_weights(critic, scratch, head="init")
        checkpointing.remove_scratch(scratch)
    return critic


def init_weights(engine, source: str) -> None:
    """Initial weights from a gspo-megatron checkpoint or a Hugging Face directory."""
    from gspo_megatron.checkpoint.meta import architecture_difference, is_checkpoint, read_meta
    from gspo_megatron.checkpoint.reading import read_model_config
    from gspo_megatron.megatron.weight_loading import load_engine_weights

    path = Path(source)
    if is_checkpoint(path) or (path / "config.json").is_file():
        saved = read_model_config(path).to_dict()
        difference = architecture_difference(saved, engine.model_config)
        if difference:
            raise ConfigError(f"model.init_from={source}: {difference}")
        lora = read_meta(path).get("lora") if is_checkpoint(path) else None
        if lora:
            raise ConfigError(
                f"model.init_from={source} holds LoRA adapters (lora.rank={lora['rank']}): "
                "starting or evaluating from a LoRA checkpoint is not built yet; its run resumes "
                "with trainer.resume, or start from its merged conversion "
                "(tools/convert_megatron_to_hf.py; docs/LORA.md)"
            )
        load_engine_weights(engine, path)
        return
    raise ConfigError(
        f"model.init_from={source}: neither a gspo-megatron checkpoint ({path}/"
        "gspo_checkpoint.json) nor a Hugging Face directory (config.json)"
    )


def build_rollout(cfg: RunConfig, policy, run_dir: Path):
    """The rollout engine of rollout.engine's backend (rollout/backends.py) and the weight
    source it syncs from (None when it shares the policy's weights). It keeps what a resumed
    run must know in `run_dir` (SGLang: the servers' released memory, docs/SGLANG.md, "Server
    memory")."""
    from gspo_megatron.notes import note
    from gspo_megatron.rollout.backends import RunContext, rollout_backend

    run = RunContext(run_dir=Path(run_dir), announce=note)
    return rollout_backend(cfg.rollout.engine).build(cfg, policy, run)
