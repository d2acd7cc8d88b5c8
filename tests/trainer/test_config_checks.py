"""Combinations gspo-train refuses at config time, each naming its keys and the reason."""

from __future__ import annotations

import pytest

from gspo_megatron.config import ConfigError, resolve
from gspo_megatron.memory_plan import compose, plan, settings_from_config


def resolved(*overrides: str):
    return resolve(compose(list(overrides)), 1)


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
    ],
    ids=["coef-without-type", "type-without-coef", "dense", "sinkhorn", "moved-key",
         "mismatch-with-rollout-logprobs", "token-weights-for-gspo"],
)  # fmt: skip
def test_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolved(*overrides)
    assert message in str(err.value)


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
