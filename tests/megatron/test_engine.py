"""Engine behaviour in real megatron processes: gradient vs the algorithms library, routing
replay, exact resume, checkpoints across layouts, non-finite steps and input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import finish_worker, run_worker, start_worker

WORKER = Path(__file__).resolve().parent / "engine_worker.py"


LORA_RESUME_CHECKS = {
    "lora_resume_weights_identical",
    "lora_resume_loss_and_grad_norm_identical",
    "lora_b_trained_from_zero",
    "lora_adam_state_elements_minus_adapters",
    "error_lora_checkpoint_into_full_engine",
    "error_lora_checkpoint_into_other_rank",
    "error_lora_checkpoint_weights_without_adapters",
}
OFFLOAD_CHECKS = {
    "offload_optimizer_state_bitwise_identical",
    "offload_all_state_bitwise_identical",
    "offload_optimizer_metrics_identical",
    "offload_all_metrics_identical",
    "offload_all_frees_weights_and_gradients",
    "offload_optimizer_keeps_weights_and_gradients",
    "offload_all_frees_optimizer_state",
    "offload_saved_checkpoint_resumes_exactly",
    "offload_train_while_offloaded_refused",
}
# The one-process gradient sync (training_engine.grad_finalizer)
GRAD_SYNC_CHECKS = {
    "grad_sync_shortcut_only_in_one_process",
    "grad_sync_weights_as_megatron",
    "grad_sync_grad_norms_as_megatron",
}


def assert_all_ok(results: list[dict], expected: set[str]) -> None:
    names = {r["check"] for r in results}
    assert expected <= names, expected - names
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed


def test_single_process_checks(tmp_path):
    """One launch: in-schedule loss gradient == autograd through policy_loss (gspo, grpo,
    gspo_token, ppo with an entropy bonus); routing replay; Adam resume, LoRA's too; LoRA over
    base weights from HF and from a checkpoint; non-finite handling; bad input; offloading the
    state between steps (bitwise identical, storages freed, saved while offloaded); the gradient
    sync's one-process shortcut trains as megatron's finalize_model_grads."""
    results = run_worker(
        WORKER,
        [
            "--mode",
            "gradient,replay,resume,lora-resume,lora-init-from,nonfinite,bad-input,offload,"
            "grad-sync",
            "--workdir",
            str(tmp_path),
        ],
    )
    assert_all_ok(
        results,
        {
            "gspo_grad_max_abs_diff_rel",
            "grpo_grad_max_abs_diff_rel",
            "gspo_token_grad_max_abs_diff_rel",
            "ppo_grad_max_abs_diff_rel",
            "replay_reproduces_recorded_routes",
            "replay_matches_router_choice_same_weights",
            "route_change_fraction_without_replay",
            "replay_after_update_uses_old_routes",
            "resume_params_identical",
            "nonfinite_skip",
            "nonfinite_raise",
            "error_too_long",
            "error_empty_response",
            "error_other_architecture",
            *LORA_RESUME_CHECKS,
            "lora_init_from_hf_bitwise_base",
            "lora_init_from_checkpoint_bitwise_base",
            "error_lora_checkpoint_as_initial_weights",
            *OFFLOAD_CHECKS,
            *GRAD_SYNC_CHECKS,
        },
    )


@pytest.mark.distributed
def test_resume_lora_resume_and_offload_with_distributed_optimizer_over_two_ranks(tmp_path):
    """Exact resume (LoRA too: adapters and their Adam state through the checkpoint, sharded
    over two data-parallel ranks) and offloading, with the distributed optimizer; the gradient
    sync keeps megatron's collectives over two ranks (the one-process shortcut would differ)."""
    results = run_worker(
        WORKER,
        ["--mode", "resume,lora-resume,offload,grad-sync", "--workdir", str(tmp_path)],
        nproc=2,
    )
    assert_all_ok(
        results,
        {
            "resume_params_identical",
            "resume_grad_norm_identical",
            *LORA_RESUME_CHECKS,
            *OFFLOAD_CHECKS,
            *GRAD_SYNC_CHECKS,
            "grad_sync_shortcut_would_differ_over_ranks",
        },
    )


@pytest.mark.distributed
def test_checkpoint_from_tp2_ep2_loads_on_one_process_and_pp2(tmp_path):
    run_worker(
        WORKER,
        ["--mode", "save-layout", "--layout", "tp=2,sp=1,ep=2", "--workdir", str(tmp_path)],
        nproc=4,
    )
    # The two loads read the same checkpoint side by side (one core each).
    single = start_worker(WORKER, ["--mode", "load-layout", "--workdir", str(tmp_path)])
    pp2 = start_worker(
        WORKER,
        ["--mode", "load-layout", "--layout", "pp=2", "--workdir", str(tmp_path)],
        nproc=2,
    )
    assert_all_ok(
        finish_worker(single), {"loaded_logprobs_max_abs_diff", "optimizer_across_ep_refused"}
    )
    assert_all_ok(finish_worker(pp2), {"loaded_logprobs_max_abs_diff"})
