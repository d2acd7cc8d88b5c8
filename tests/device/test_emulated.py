"""The engine, routing replay, embedded rollout and weight export under the emulated accelerator:
every tensor the model, a collective on a would-be-NCCL group or a device-side op sees is where
a GPU run needs it (see tests/device_emulation.py).

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


TWO_RANK_CASES = {
    "tp2-sequence-parallel-moe": ("tp=2,sp=1", "train,forward,replay,rollout,export"),
    "ep2": ("ep=2", "train,forward,replay,rollout,export,offload"),
    "pp2": ("pp=2", "train,replay,export"),
    "cp2": ("cp=2", "train,forward,replay"),
}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict]]:
    """Every two-rank case in one launch (process start-up is much of a case's time): the
    results by layout."""
    args = [
        a
        for layout, modes in TWO_RANK_CASES.values()
        for a in ("--layout", layout, "--modes", modes)
    ]
    results = run_worker(WORKER, args, nproc=2)
    return {
        layout: [r for r in results if r["layout"] == layout]
        for layout, _ in TWO_RANK_CASES.values()
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("tp2-sequence-parallel-moe", TRAIN | FORWARD | REPLAY | EXPORT | {"rollout_megatron"}),
        ("ep2", TRAIN | FORWARD | REPLAY | EXPORT | OFFLOAD | {"rollout_megatron"}),
        ("pp2", TRAIN | REPLAY | EXPORT),
        ("cp2", TRAIN | FORWARD | REPLAY),
    ],
)
def test_two_ranks(two_ranks, case, expected):
    assert_all_ok(two_ranks[TWO_RANK_CASES[case][0]], expected)
