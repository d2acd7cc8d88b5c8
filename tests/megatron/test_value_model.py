"""The value model (PPO's critic): the value engine against computations of its own, and the
same values, metrics, gradients and weights on every parallel layout.

One process per model (tiny_moe, and tiny_dense for tensor parallelism without sequence
parallelism) with the value head set from a seeded generator (its zero init would give the trunk
no gradient): values equal megatron's final-norm hidden states dotted with the head (<=1e-5);
the gradient of each of two SGD steps equals autograd through the clipped value loss written
out in float64 (<=1e-5 of the largest entry); loss, clip fraction and explained variance equal
the same reference's; the step lowers the loss; frozen and policy engines refuse
train_value_step and a value engine refuses train_step. Every layout then loads the reference's
initial weights and, padded and packed over several micro-batches, matches its values (<=1e-5),
metrics (<=1e-6), gradients (<=1e-5 of each tensor's largest entry, every parameter) and weights
(<=1e-6 relative) after both steps (tests/megatron/value_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import finish_worker, layouts_by_launch, start_worker

WORKER = Path(__file__).resolve().parent / "value_worker.py"
MODELS = ("tiny_moe", "tiny_dense")

# (the worker's [model:]layout, processes, test id); tiny_moe unless named.
LAYOUTS = [
    ("tp=2,sp=1", 2, "tp2-sp"),
    ("pp=2", 2, "pp2"),
    ("ep=2", 2, "ep2"),
    ("cp=2", 2, "cp2"),
    ("", 2, "dp2"),
    ("tiny_dense:tp=2", 2, "dense-tp2"),  # MoE needs sequence parallelism with tp > 1
    ("tiny_dense:pp=2", 2, "dense-pp2"),  # tied embeddings, untied for the value head
    # A critic on process groups of its own beside a policy on another layout (critic@policy).
    ("pp=2@tp=2,sp=1", 2, "pp2-beside-policy-tp2-sp"),
    ("tp=2,sp=1@ep=2", 2, "tp2-sp-beside-policy-ep2"),
]
# tp2+sp+pp2+ep2 on 4 ranks also matched (gradients 7.2e-7); left out for time: the policy's
# layout tests compose the parallelisms, the value model only adds its head on the last stage.
STEP_CHECKS = (
    "loss_abs_diff",
    "value_loss_abs_diff",
    "value_clip_fraction_abs_diff",
    "values_abs_diff",
    "returns_abs_diff",
    "ev_returns_sq_abs_diff",
    "ev_residual_abs_diff",
    "ev_residual_sq_abs_diff",
    "explained_variance_abs_diff",
    "grad_rel_diff",
    "params_without_reference_grad",
    "params_rel_diff",
    "values_after_max_abs_diff",
)


@pytest.fixture(scope="module")
def value_reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The references of both models (side by side), and the checks they printed."""
    out = tmp_path_factory.mktemp("value_reference")
    procs = [
        start_worker(WORKER, ["--make-reference", str(out), "--model", model]) for model in MODELS
    ]
    return out, [line for proc in procs for line in finish_worker(proc)]


@pytest.fixture(scope="module")
def layout_checks(value_reference):
    return layouts_by_launch(WORKER, LAYOUTS, ["--ref-dir", str(value_reference[0])])


@pytest.mark.parametrize("model", MODELS)
def test_value_engine_matches_its_own_reference(value_reference, model):
    results = [r for r in value_reference[1] if r["layout"] == f"{model}:single"]
    checks = {r["check"]: r for r in results}
    expected = {
        "zero_initialised_head_values_max_abs",
        "values_vs_hidden_dot_head_max_abs_diff",
        "sgd_step_lowers_the_loss",
        "frozen_copy_values_max_abs_diff",
        "frozen_value_engine_refuses_train_value_step",
        "policy_engine_refuses_train_value_step",
        "value_engine_refuses_train_step",
        "value_step_without_returns_refused",
        "refused_steps_leave_weights_untouched",
    }
    for step in ("step1", "step2"):
        expected |= {
            f"{step}/{kind}"
            for kind in (
                "grad_vs_autograd_max_abs_diff_rel",
                "loss_vs_reference_abs_diff",
                "clip_fraction_vs_reference_abs_diff",
                "explained_variance_vs_reference_abs_diff",
            )
        }
        # The seeded head gives the trunk a gradient, and the clip bites on some tokens only.
        assert checks[f"{step}/trunk_grad_max_abs"]["value"] > 1e-3
        assert 0.05 < checks[f"{step}/clip_fraction"]["value"] < 0.95
    assert expected <= checks.keys(), expected - checks.keys()
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "nproc"), [pytest.param(text, n, id=name) for text, n, name in LAYOUTS]
)
def test_value_model_layout_matches_single_process(layout_checks, layout, nproc):
    results = layout_checks(layout, nproc)
    checks = {r["check"]: r for r in results}
    expected = {
        "loaded_head_vs_seeded_max_abs_diff",
        "one_head_per_last_stage_rank",
        "frozen_copy_values_max_abs_diff",
    }
    for mode in ("padded", "packed"):
        expected.add(f"{mode}/values_max_abs_diff")
        for step in ("step1", "step2"):
            expected |= {f"{mode}/{step}/{kind}" for kind in STEP_CHECKS}
            # Several micro-batches per rank, against the reference's single one.
            assert checks[f"{mode}/{step}/min_microbatches_per_rank"]["value"] >= 2
    if "@" in layout:
        expected.add("policy_logprobs_unchanged_after_building_the_critic")
        expected |= {
            f"policy_logprobs_unchanged_after_{mode}_{step}"
            for mode in ("padded", "packed")
            for step in ("step1", "step2")
        }
    assert expected <= checks.keys(), expected - checks.keys()
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
