"""Combinations gspo-train refuses at config time, each naming its keys and the reason."""

from __future__ import annotations

import pytest
import yaml
from trainer.fakes import ConfigComposer

from gspo_megatron.config import ConfigError, compose, resolve
from gspo_megatron.memory_plan import plan, settings_from_config

COMPOSER = ConfigComposer()  # config.compose's result, each preset composed once


def resolved(*overrides: str):
    return resolve(COMPOSER.raw(*overrides), 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.moe_aux_loss_coef=0.01"],
         "algorithm.moe_aux_loss_coef=0.01 with algorithm.moe_aux_loss=none"),
        (["algorithm.moe_aux_loss=aux_loss"],
         "algorithm.moe_aux_loss=aux_loss needs algorithm.moe_aux_loss_coef > 0"),
        (["model=tiny_dense", "algorithm.moe_aux_loss=seq_aux_loss",
          "algorithm.moe_aux_loss_coef=0.01"],
         "algorithm.moe_aux_loss needs a Mixture-of-Experts model"),
        (["algorithm.moe_aux_loss=sinkhorn", "algorithm.moe_aux_loss_coef=0.01"],
         "algorithm.moe_aux_loss='sinkhorn' is not one of"),
        (["+model.router_aux_loss_coef=0.0"],
         "model.router_aux_loss_coef is no longer a setting: the MoE load-balancing loss of RL "
         "training is algorithm.moe_aux_loss"),
        (["algorithm.mismatch=tis", "algorithm.old_logprobs=rollout"],
         "algorithm.mismatch=tis needs algorithm.old_logprobs=recompute"),
        (["algorithm.mismatch=mis", "algorithm.mismatch_level=token"],
         "algorithm.mismatch=mis at algorithm.mismatch_level=token with algorithm.loss=gspo: a "
         "sequence-ratio loss has one term per sequence"),
        (["engine.max_sequence_length=128", "engine.max_tokens_per_microbatch=100"],
         "engine.max_tokens_per_microbatch=100 is below engine.max_sequence_length=128"),
        (["env.name=nope"], "unknown env.name='nope'"),
        (["rollout.max_new_tokens=3"],
         "rollout.max_new_tokens=3 leaves no room for the end token after data.task=copy's "
         "longest answer (3 characters)"),
        (["data.task=add", "rollout.max_new_tokens=8", "eval.heldout.max_new_tokens=4"],
         "eval.heldout.max_new_tokens=4 leaves no room for the end token after data.task=add's "
         "longest answer (4 characters)"),
        (["data.task=expr"],
         "data.task=expr labels are code problems, which reward.name=synthetic cannot score"),
        (["reward=code"],
         "reward.name=code runs programs on a label's tests; data.task=copy's labels are answer "
         "strings"),
        (["reward=code", "data.task=expr", "rollout.max_new_tokens=3"],
         "rollout.max_new_tokens=3 leaves no room for the end token after data.task=expr's "
         "longest answer (3 characters): the code reward gives full credit only to the answer "
         "followed by the end token"),
        (["logging.costly_metrics_every=0"], "logging.costly_metrics_every must be >= 1, got 0"),
    ],
    ids=["coef-without-type", "type-without-coef", "dense", "sinkhorn", "moved-key",
         "mismatch-with-rollout-logprobs", "token-weights-for-gspo", "sequence-over-budget",
         "env-unknown", "no-room-for-the-end-token",
         "no-room-for-the-end-token-in-evaluation", "code-task-without-code-reward",
         "code-reward-without-code-task", "no-room-for-the-end-token-in-code",
         "costly-metrics-every-0"],
)  # fmt: skip
def test_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolved(*overrides)
    assert message in str(err.value)


ADAPTER_SYNC = ["rollout.sglang.lora_sync=adapter", "rollout.sglang.weight_sync=disk",
                "+rollout.sglang.disk_dir=/shared/adapters"]  # fmt: skip
ATTENTION = "lora.targets=[attention.linear_qkv,attention.linear_proj]"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora.rank=0"], "lora.rank must be >= 1, got 0"),
        (["lora.rank=-2"], "lora.rank must be >= 1, got -2"),
        (["lora.alpha=16"], "lora.alpha is set but LoRA is off (lora.rank=null)"),
        (["lora.rank=8", "lora.targets=[mlp.linear_fc1]"],
         "lora.targets entry 'mlp.linear_fc1' matches nothing in the model (a Mixture-of-Experts "
         "model has experts, no dense MLP)"),
        (["model=tiny_dense", "lora.rank=8", "lora.targets=[experts.linear_fc2]"],
         "lora.targets entry 'experts.linear_fc2' matches nothing in the model (a dense model "
         "has a dense MLP, no experts)"),
        (["lora.rank=8", "lora.targets=[router]"],
         "lora.targets entry 'router': the router is never adapted"),
        (["lora.rank=8", "lora.targets=[q_proj]"],
         "lora.targets entry 'q_proj' is not a layer LoRA adapts"),
        (["lora.rank=8", "lora.targets=[]"], "lora.targets is empty"),
        (["lora.rank=8", "lora.dropout=0.1"],
         "lora.rank=8 with lora.dropout=0.1: dropout would make the trained forward a random "
         "perturbation"),
        (["lora.rank=8", "engine.use_te=true"], "lora.rank=8 with engine.use_te=true"),
        (["lora.rank=8", "rollout=sglang", "rollout.sglang.lora_sync=adapter", ATTENTION],
         "rollout.sglang.lora_sync=adapter with rollout.sglang.weight_sync=tensor: the "
         "adapters reach the servers as a PEFT directory"),
        (["lora.rank=8", "rollout=sglang", *ADAPTER_SYNC, ATTENTION,
          "lora.modules_to_save=[output_layer]"],
         "rollout.sglang.lora_sync=adapter with lora.modules_to_save=['output_layer']: SGLang's "
         "LoRA API loads lora_A/lora_B pairs"),
        (["lora.rank=8", "rollout=sglang", *ADAPTER_SYNC],
         "rollout.sglang.lora_sync=adapter with lora.targets=['all-linear'], which adapts "
         "experts.linear_fc1, experts.linear_fc2: the PEFT adapter names expert adapters by "
         "target_parameters"),
        (["lora.rank=8", "rollout=sglang", *ADAPTER_SYNC, ATTENTION,
          "+rollout.sglang.launch=[{model_path: m, port: 30001, dp_size: 2}]"],
         "rollout.sglang.launch[0].dp_size=2 with rollout.sglang.lora_sync=adapter: SGLang "
         "refuses dynamic LoRA loading with data-parallel replicas"),
        (["rollout=sglang", "rollout.sglang.lora_sync=adapter"],
         "rollout.sglang.lora_sync=adapter with lora.rank=null: there are no adapters to sync"),
        (["lora.rank=8", "lora.modules_to_save=[lm_head]"],
         "lora.modules_to_save entry 'lm_head' is not one of ['output_layer', 'final_norm', "
         "'embedding']"),
        (["model=tiny_dense", "lora.rank=8", "lora.modules_to_save=[embedding]"],
         "lora.modules_to_save entry 'embedding' on a model with tie_word_embeddings=true"),
        (["lora.rank=8", "lora.modules_to_save=[output_layer]", "algorithm.kl_coef=0.1"],
         "lora.rank=8 with lora.modules_to_save=['output_layer'] and a KL penalty"),
        (["lora.modules_to_save=[output_layer]"], "lora.modules_to_save is set but LoRA is off"),
    ],
    ids=["rank-0", "rank-negative", "alpha-without-rank", "dense-target-on-moe",
         "expert-target-on-dense", "router", "unknown-target", "no-targets", "dropout", "te",
         "sglang-adapter-tensor", "sglang-adapter-saved", "sglang-adapter-experts",
         "sglang-adapter-dp", "sglang-adapter-without-lora", "saved-unknown",
         "saved-tied", "saved-with-kl", "saved-without-rank"],
)  # fmt: skip
def test_lora_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolve(compose(overrides), 1, check_inputs=False)  # Hydra's: lists too
    assert message in str(err.value)


def test_lora_resolves_on_moe_and_dense_models():
    from gspo_megatron.spec.lora import resolve_targets

    cfg, model, _ = resolved("lora.rank=8")
    assert (cfg.lora.rank, cfg.lora.scaling) == (8, 4.0)
    assert resolve_targets(cfg.lora.targets, model.is_moe) == {
        "attention.linear_qkv", "attention.linear_proj", "experts.linear_fc1",
        "experts.linear_fc2",
    }  # fmt: skip
    for mode in ("one_step_off", "async"):  # the generator process merges the adapters
        assert resolved("lora.rank=8", f"rollout.mode={mode}")[0].rollout.mode == mode
    # SGLang is sent the merged weights, or the adapters (attention targets, through disk_dir)
    raw = compose(["lora.rank=8", "rollout=sglang"])
    assert resolve(raw, 1, check_inputs=False)[0].rollout.sglang.lora_sync == "merged"
    raw = compose(["lora.rank=8", "rollout=sglang", *ADAPTER_SYNC, ATTENTION])
    assert resolve(raw, 1, check_inputs=False)[0].rollout.sglang.lora_sync == "adapter"
    # the Hugging Face export beside each checkpoint is the merged model (megatron/hf_export.py)
    assert resolved("lora.rank=8", "trainer.export_hf_every=5")[0].trainer.export_hf_every == 5
    raw = compose(["model=tiny_dense", "lora.rank=2", "lora.targets=[mlp.linear_fc2]"])
    cfg, model, _ = resolve(raw, 1)
    assert resolve_targets(cfg.lora.targets, model.is_moe) == {"mlp.linear_fc2"}


def test_ppo_critic_with_a_lora_policy():
    """The critic trains full-parameter from the policy's base; on a layout of its own it would
    start from a scratch checkpoint of the LoRA policy, refused unless it has weights to read."""
    assert resolved("lora.rank=8", "algorithm=ppo")[0].algorithm.advantage == "gae"
    own = ["lora.rank=8", "algorithm=ppo", "critic.parallel.ep=2"]
    with pytest.raises(ConfigError) as err:
        resolve(compose(own), 2, check_inputs=False)
    assert "lora.rank=8 with algorithm.advantage=gae, a critic.parallel layout of its own" in str(
        err.value
    )
    cfg, _, _ = resolve(
        compose([*own, "critic.init_from=/some/value_model"]), 2, check_inputs=False
    )
    assert cfg.critic.init_from == "/some/value_model"


def test_the_code_experiment_resolves():
    cfg, _, _ = resolve(compose(["+experiment=code_cpu"]), 1)
    assert (cfg.data.task, cfg.reward.name, cfg.model.tokenizer) == ("expr", "code", "char_expr")


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_environments_resolve_with_batches_generated_ahead(mode):
    cfg, _, _ = resolve(compose(["+experiment=calculator_cpu", f"rollout.mode={mode}"]), 1)
    assert (cfg.env.name, cfg.rollout.mode) == ("calculator", mode)


def test_environment_kwargs_checked_against_the_class():
    with pytest.raises(ConfigError, match="env.kwargs do not fit environment 'retrieval'"):
        resolve(compose(["env=retrieval", "+env.kwargs.depth=3"]), 1)


def test_moe_aux_loss_choices_resolve():
    for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        cfg, _, _ = resolved(f"algorithm.moe_aux_loss={kind}", "algorithm.moe_aux_loss_coef=0.001")
        assert (cfg.algorithm.moe_aux_loss, cfg.algorithm.moe_aux_loss_coef) == (kind, 0.001)
    cfg, _, _ = resolved()
    assert (cfg.algorithm.moe_aux_loss, cfg.algorithm.moe_aux_loss_coef) == ("none", 0.0)


def test_memory_plan_counts_the_kl_reference():
    """The frozen reference holds one more copy of the weights: no gradients, no optimizer."""
    plans = {}
    for kl in (0.0, 0.1):
        cfg, model, layout = resolved("model=qwen3_30b_a3b", f"algorithm.kl_coef={kl}")
        settings = settings_from_config(cfg, model, layout, gpu_memory_gib=141.0)
        plans[kl] = plan(model, layout, settings).stages[0]
    without, with_ref = plans[0.0], plans[0.1]
    assert without.reference == 0.0
    assert with_ref.reference == pytest.approx(with_ref.weights)
    assert with_ref.static == pytest.approx(without.static + with_ref.weights)
    assert (with_ref.grads, with_ref.optimizer) == (without.grads, without.optimizer)


def _constrained_fields(cls, prefix: str = ""):
    """(key, field) of every field declared with a range or choices, recursively."""
    import dataclasses

    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        default = f.default_factory() if callable(f.default_factory) else f.default
        if dataclasses.is_dataclass(default):
            yield from _constrained_fields(type(default), key)
        elif "range" in f.metadata or "choices" in f.metadata:
            yield key, f


def _invalid(f) -> str:
    if "choices" in f.metadata:
        return "not_a_choice"
    bounds = f.metadata["range"]
    if bounds["ge"] is not None:
        return str(bounds["ge"] - 1)
    if bounds["gt"] is not None:
        return str(bounds["gt"])
    return str((bounds["le"] if bounds["le"] is not None else bounds["lt"]) + 1)


def _exists(raw: dict, key: str) -> bool:
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


SECTIONS = (
    "model|parallel|algorithm|rollout|data|reward|trainer|optimizer|engine|lora|logging|stability"
)
KEY = rf"\b(?:{SECTIONS})\.[a-z_0-9]+\b"


def test_every_constrained_field_is_refused_naming_its_own_key():
    """For each field with a range or choices, a value outside it is refused at config time
    with a message that names that key, and every key the message names exists."""
    import re

    from gspo_megatron.config import RunConfig

    raw = compose([])
    fields = list(_constrained_fields(RunConfig))
    assert len(fields) > 40
    for key, f in fields:
        override = f"{key}={_invalid(f)}"
        with pytest.raises(ConfigError) as err:
            if key.startswith("rollout.sglang."):
                # A mapping in Hydra's schema (so `+rollout.sglang.KEY=...` adds keys): the value
                # goes into the composed dict, typed as YAML would give it.
                raw = COMPOSER.raw()
                raw["rollout"]["sglang"][key.rsplit(".", 1)[1]] = yaml.safe_load(_invalid(f))
                resolve(raw, 1)
            else:
                resolved(override)
        message = str(err.value)
        assert message.startswith(key), (override, message)
        for named in re.findall(KEY, message):
            assert _exists(raw, named), (override, named, message)


def test_every_key_in_a_config_message_exists():
    """The keys named anywhere in the config checks' messages (config.py and the sections it
    uses) are keys of the composed config (or of earlier versions, in the rename table)."""
    import ast
    import re
    from pathlib import Path

    import gspo_megatron
    from gspo_megatron.config import old_key_message

    raw = compose(["algorithm.mismatch=tis"])  # any valid config: the keys are the same
    package = Path(gspo_megatron.__file__).parent
    sources = ["config.py", "data/config.py", "rewards/registry.py", "envs/registry.py",
               "spec/training.py", "spec/lora.py", "rollout/backends.py",
               "rollout/sglang/backend.py", "rollout/sglang/config.py",
               "rollout/embedded/backend.py",
               "memory_plan.py", "run_health.py", "components.py", "evaluation/config.py",
               "stability/rollback.py", "stability/sentinel.py", "stability/budget.py",
               "stability/monitor.py", "algorithms/losses.py",
               "evaluation/benchmarks.py", "evaluate.py"]  # fmt: skip
    named = set()
    for source in sources:
        tree = ast.parse((package / source).read_text())
        texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        for text in texts:
            if isinstance(text, str) and "gspo_megatron." not in text:
                named |= set(re.findall(KEY, text))
    assert len(named) > 30
    unknown = [k for k in sorted(named) if not _exists(raw, k) and not old_key_message(k)]
    assert not unknown, unknown
