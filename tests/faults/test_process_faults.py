"""Processes off the happy path, through `gspo-train` under gspo_megatron.torchrun with two
ranks: SIGTERM checkpoints and exits 0; a rank killed or hung makes the other leave within
seconds with a message; a checkpoint damaged on one rank only is rejected by both together; a
batch corrupted on one rank only rolls both back together (the collapse sentinel).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from launch import REPO, gspo_train, gspo_train_command, gspo_train_env, read_metrics

pytestmark = pytest.mark.distributed

TWO_RANKS = [
    "parallel=ep2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        gspo_train_command(run_dir, [*TWO_RANKS, *overrides], nproc=2),
        env=gspo_train_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_records(run_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 300):
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= count:
            return
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no {count} metrics records: {proc.communicate()[0][-3000:]}")


def worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of rank {rank}")


def kill_tree(proc: subprocess.Popen) -> str:
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    return proc.communicate()[0]


def test_sigterm_under_torchrun_checkpoints_and_exits_zero(tmp_path):
    proc = start(tmp_path, "trainer.steps=500")
    wait_for_records(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    steps = len(read_metrics(tmp_path))
    assert 2 <= steps < 500
    assert (tmp_path / "checkpoints" / f"step_{steps:06d}" / "manifest.json").is_file()
    assert "Traceback" not in out and "SignalException" not in out


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_other_rank_leaves_within_seconds_when_one_is_gone(tmp_path, fault):
    """kill -9 of rank 1: gloo sees its sockets close. SIGSTOP of rank 1 (a hang, or a node that
    vanished): only the heartbeat watchdog notices, after trainer.peer_timeout_s."""
    proc = start(tmp_path, "trainer.steps=500", "trainer.peer_timeout_s=5")
    wait_for_records(tmp_path, 2, proc)
    survivor = worker(proc, 0)
    victim = worker(proc, 1)
    victim.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    gone_at = time.monotonic()
    try:
        survivor.wait(timeout=60)
    except psutil.TimeoutExpired:
        pytest.fail(f"rank 0 still running 60 s after rank 1 was {fault}: {kill_tree(proc)}")
    elapsed = time.monotonic() - gone_at
    out = kill_tree(proc)
    assert elapsed < (5 if fault == "killed" else 15), elapsed
    assert "gspo-train: rank 0: " in out, out[-3000:]
    if fault == "hung":
        assert "rank 1 sent no heartbeat" in out


def test_checkpoint_damaged_on_one_rank_is_rejected_by_both(tmp_path):
    """Rank 1's RNG file of the newest checkpoint is damaged: both ranks fall back to the
    previous checkpoint together (no rank resumes at a different step, nothing hangs)."""
    gspo_train(tmp_path, *TWO_RANKS, "trainer.steps=2", "trainer.save_every=1", nproc=2)
    rng = tmp_path / "checkpoints" / "step_000002" / "rng" / "rank_00001.pt"
    raw = bytearray(rng.read_bytes())
    raw[-64:] = bytes(64)
    rng.write_bytes(bytes(raw))
    proc = gspo_train(
        tmp_path, *TWO_RANKS, "trainer.steps=3", "trainer.save_every=1", nproc=2, timeout=300
    )
    assert "rank_00001.pt: checksum mismatch" in proc.stderr
    assert "resumed at step 1" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.slow
def test_a_batch_corrupted_on_one_rank_rolls_both_back_together(tmp_path):
    """Rank 1's samples of step 5 carry NaN old log-probs: the non-finite loss and gradient
    reach both ranks through the reductions, every rank's sentinel votes in one all-reduce, and
    both roll back to step 2 together (one rollback, one record per step, nothing hangs)."""
    proc = gspo_train(
        tmp_path, *TWO_RANKS, "trainer.steps=6", "trainer.save_every=2", "seed=5",
        "stability.sentinel.nonfinite_patience=1", nproc=2, timeout=600,
        faults="nan_batch_at_optimizer_step=17", fault_rank=1,  # step 5's first optimizer step
    )  # fmt: skip
    assert "step 5: the collapse sentinel fired (nonfinite:" in proc.stderr
    assert "rollback 1 of at most 3 to step_000002" in proc.stderr
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[2]["stability/rolled_back_from"] == 5
    (rollback,) = json.loads((tmp_path / "rollbacks.json").read_text())
    assert (rollback["fired_at"], rollback["to_step"], rollback["status"]) == (5, 2, "done")
    side = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in side] == [3, 4, 5]
    assert (tmp_path / "checkpoints" / "step_000006" / "manifest.json").is_file()
