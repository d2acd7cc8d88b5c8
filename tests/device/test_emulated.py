"""The engine, routing replay, embedded rollout and weight export under the emulated accelerator:
every tensor the model, a collective on a would-be-NCCL group or a device-side op sees is where
a GPU run needs it (see gspo_megatron/megatron/device_emulation.py).

Each launch first proves the emulation is on (a mixed op is refused; the parameters are device
tensors), so no check here can pass because the emulation was silently off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_worker

WORKER = Path(__file__).resolve().parent / "emulated_worker.py"
PROOF = {"mixed_op_refused", "params_on_device"}
TRAIN = {"train_step_adam", "optimizer_steps"}
FORWARD = {"forward_logprobs", "forward_entropy", "forward_routes"}
REPLAY = {"r2_route_change_measured", "r2_replay_step", "r3_replay_forward"}
EXPORT = {"export_names", "export_buckets_on_device"}
OFFLOAD = {
    "offload_leaves_nothing_on_device",
    "offload_copies_on_host",
    "offload_reload_then_train",
}


def assert_all_ok(results: list[dict], expected: set[str]) -> None:
    names = {r["check"] for r in results}
    assert PROOF | expected <= names, (PROOF | expected) - names
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed


def test_single_process():
    """Training with Adam (distributed optimizer) and SGD, the old-policy forward with routes,
    R2/R3 replay, both embedded decoders, weight export, offloading the training state."""
    results = run_worker(WORKER, ["--modes", "train,forward,replay,rollout,export,offload"])
    assert_all_ok(
        results,
        TRAIN
        | FORWARD
        | REPLAY
        | EXPORT
        | OFFLOAD
        | {"train_step_sgd", "rollout_torch", "rollout_megatron"},
    )


@pytest.mark.distributed
def test_tp2_sequence_parallel_moe():
    results = run_worker(
        WORKER,
        ["--layout", "tp=2,sp=1", "--modes", "train,forward,replay,rollout,export"],
        nproc=2,
    )
    assert_all_ok(results, TRAIN | FORWARD | REPLAY | EXPORT | {"rollout_megatron"})


@pytest.mark.distributed
def test_ep2():
    results = run_worker(
        WORKER,
        ["--layout", "ep=2", "--modes", "train,forward,replay,rollout,export,offload"],
        nproc=2,
    )
    assert_all_ok(results, TRAIN | FORWARD | REPLAY | EXPORT | OFFLOAD | {"rollout_megatron"})


@pytest.mark.distributed
def test_pp2():
    results = run_worker(WORKER, ["--layout", "pp=2", "--modes", "train,replay,export"], nproc=2)
    assert_all_ok(results, TRAIN | REPLAY | EXPORT)


@pytest.mark.distributed
def test_cp2():
    results = run_worker(WORKER, ["--layout", "cp=2", "--modes", "train,forward,replay"], nproc=2)
    assert_all_ok(results, TRAIN | FORWARD | REPLAY)
