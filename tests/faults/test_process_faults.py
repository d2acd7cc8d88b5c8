"""Processes off the happy path, through `gspo-train` under gspo_megatron.torchrun with two
ranks: SIGTERM checkpoints and exits 0; a rank killed or hung makes the other leave within
seconds with a message; the workers die with a killed launcher; a checkpoint damaged on one rank
only is rejected by both together; a batch corrupted on one rank only rolls both back together
(the collapse sentinel); what the user sees is our lines, not the libraries' noise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from launch import REPO, TINY_RUN, gspo_train, gspo_train_command, gspo_train_env, read_metrics

pytestmark = pytest.mark.distributed

TWO_RANKS = ["parallel=ep2", *TINY_RUN]


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
    vanished): only the heartbeat watchdog notices, after trainer.peer_timeout_s. For the kill,
    the watchdog waits 60 s, so leaving within 30 s (a margin for a loaded machine) is gloo's."""
    peer_timeout_s = 60 if fault == "killed" else 5
    proc = start(tmp_path, "trainer.steps=500", f"trainer.peer_timeout_s={peer_timeout_s}")
    wait_for_records(tmp_path, 2, proc)
    survivor = worker(proc, 0)
    victim = worker(proc, 1)
    victim.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    gone_at = time.monotonic()
    try:
        survivor.wait(timeout=90)
    except psutil.TimeoutExpired:
        pytest.fail(f"rank 0 still running 90 s after rank 1 was {fault}: {kill_tree(proc)}")
    elapsed = time.monotonic() - gone_at
    out = kill_tree(proc)
    assert elapsed < (30 if fault == "killed" else 15), elapsed
    assert "gspo-train: rank 0: " in out, out[-3000:]
    assert ("rank 1 sent no heartbeat" in out) == (fault == "hung"), out[-3000:]


@pytest.mark.parametrize("when", ["starting", "training"])
def test_workers_die_with_their_launcher(tmp_path, when):
    """kill -9 of gspo_megatron.torchrun: its workers die with it (PR_SET_PDEATHSIG), whether
    they were still starting (before the process group or the peer watchdog exist: they would
    wait minutes for the job's store, holding the run directory's lock) or training; nothing
    but notes reaches the terminal (no C++ stack of a failed store call)."""
    proc = start(tmp_path, "trainer.steps=500")
    if when == "training":
        wait_for_records(tmp_path, 2, proc)
    deadline = time.monotonic() + 120
    workers = []
    while len(workers) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        with contextlib.suppress(AssertionError):
            workers = [worker(proc, 0), worker(proc, 1)]
    assert len(workers) == 2, "no workers started"
    proc.kill()
    _, alive = psutil.wait_procs(workers, timeout=10)
    for p in alive:
        p.kill()
    out = proc.communicate(timeout=60)[0]
    assert not alive, f"{len(alive)} worker(s) still running 10 s after the launcher was killed"
    assert all(x.startswith("[gspo-megatron]") for x in out.splitlines() if x.strip()), out


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


def test_gspo_torchrun_says_how_each_worker_ended():
    from gspo_megatron.torchrun import describe_exits

    assert describe_exits({3: -9, 0: -15, 1: -15, 2: -15}) == (
        "ranks 0, 1, 2: SIGTERM; rank 3: killed (SIGKILL)"
    )
    assert describe_exits({1: 1, 0: -15}) == "rank 0: SIGTERM; rank 1: exit 1"


def test_libraries_noise_is_off_in_every_process_of_a_job(monkeypatch):
    """c10d's C++ warnings (each failed store call with its C++ stack, when the store's node is
    lost) and the resource tracker's "leaked semaphore" warning are off in the environment the
    job's processes inherit; a user's TORCH_CPP_LOG_LEVEL stays. (Their effect: the async kill
    test in tests/trainer/test_train_e2e.py, and the soak's launcher kills before processes
    died with their launcher.)"""
    from gspo_megatron.train import quiet_failure_noise

    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    quiet_failure_noise()
    quiet_failure_noise()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert os.environ["PYTHONWARNINGS"] == "default,ignore:resource_tracker:UserWarning"
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    quiet_failure_noise()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"


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
