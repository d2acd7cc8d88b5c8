"""Checkpoints off the happy path, each case through `gspo-train` on CPU (docs/CHECKPOINTS.md,
"When things go wrong", tabulates the outcomes): kill -9 at five points, damaged checkpoints of
every form, all checkpoints unusable, resume=never on a used directory, a longer schedule on
resume, a full disk, and crafted checkpoints through every loading entry point.

Faults are injected by tests/faults/inject (a sitecustomize module armed per run), so the
product has no test hooks. Runs use a tiny configuration: start-up dominates their cost.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import (
    REPO,
    TINY_RUN,
    checkpoint_tensors,
    gspo_train,
    gspo_train_command,
    gspo_train_env,
    read_metrics,
)

from gspo_megatron.checkpoint import manifest

VOLATILE = ("time/", "perf/")


def train(run_dir: Path, *overrides: str, **kwargs) -> subprocess.CompletedProcess:
    return gspo_train(run_dir, *TINY_RUN, *overrides, **kwargs)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_kill_9_at_five_points_then_resume_is_bitwise_exact(tmp_path):
    """One run killed five times — mid-step, mid-metrics-record, mid-save (data written, no
    manifest), just after a checkpoint's rename, and mid-rotation — and resumed each time,
    ends with the same records and weights as an uninterrupted run."""
    common = ["trainer.steps=6", "trainer.save_every=2", "seed=5"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The uninterrupted run goes on beside the killed ones (one thread each, two cores).
    log = (tmp_path / "straight.log").open("w")
    reference = subprocess.Popen(
        gspo_train_command(straight, [*TINY_RUN, *common]), env=gspo_train_env(), cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    faults = [
        "kill_after_optimizer_step=10",  # in step 3, after step 2's checkpoint
        "kill_mid_metrics=2",  # resumed at 2: half of step 4's record written
        "kill_before_manifest=1",  # resumed at 2: step 4's save has data but no manifest
        "kill_after_publish=1",  # resumed at 2: step_4 complete, rotation not run
        "kill_mid_rotation=1",  # resumed at 4: step_6 complete, step_2 half deleted
    ]
    for fault in faults:
        train(killed, *common, faults=fault, expect="killed")
        if fault.startswith("kill_before_manifest"):
            assert list((killed / "checkpoints").glob("*.tmp-*")), "no partial save was left"
            assert not step_dir(killed, 4).exists()
    train(killed, *common)
    reference.wait(timeout=600)
    log.close()
    assert reference.returncode == 0, (tmp_path / "straight.log").read_text()[-3000:]
    assert [r["step"] for r in read_metrics(killed)] == [1, 2, 3, 4, 5, 6]
    assert stable(read_metrics(killed)) == stable(read_metrics(straight))
    assert_same_weights(step_dir(straight, 6), step_dir(killed, 6))
    # interrupted saves are cleaned up; superseded records are kept aside, not dropped
    assert not list((killed / "checkpoints").glob("*.tmp-*"))
    side = (killed / "metrics.superseded.jsonl").read_text().splitlines()
    assert any(line.startswith('{"step": 4, "reward/me') for line in side)


@pytest.mark.slow
def test_kill_9_during_a_rollback_then_resume_completes_it_exactly(tmp_path):
    """A corrupted batch in step 5 (NaN old log-probs: a skipped optimizer step) fires the
    collapse sentinel, which rolls back to step 2 (step 4 is too recent: step 5's rollouts are
    its weights'). Killed right after the rollback is recorded, then again while completing it
    (the newer checkpoints moved aside, the records not yet), the resumed run completes it and
    ends with the same records and weights as a run rolled back without interruption; every
    step is recorded once, what the rollback replaced is kept aside."""
    common = ["trainer.steps=6", "trainer.save_every=2", "seed=5",
              "stability.sentinel.nonfinite_patience=1"]  # fmt: skip
    corrupted = "nan_batch_at_optimizer_step=17"  # step 5's first of 4 optimizer steps
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    log = (tmp_path / "straight.log").open("w")
    reference = subprocess.Popen(
        gspo_train_command(straight, [*TINY_RUN, *common]), env=gspo_train_env(corrupted), cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    train(killed, *common, faults=f"{corrupted},kill_after_rollback_record=1", expect="killed")
    (record,) = json.loads((killed / "rollbacks.json").read_text())
    assert (record["status"], record["fired_at"], record["to_step"]) == ("started", 5, 2)
    assert [r["step"] for r in read_metrics(killed)] == [1, 2, 3, 4, 5]
    proc = train(killed, *common, faults="kill_mid_rollback=1", expect="killed")
    assert "completing rollback 1 (step 5 -> 2 (nonfinite))" in proc.stderr
    assert not step_dir(killed, 4).exists()  # moved aside, records not rewound yet
    assert [r["step"] for r in read_metrics(killed)] == [1, 2, 3, 4, 5]
    proc = train(killed, *common)
    assert "resumed at step 2, rolled back" in proc.stderr
    reference.wait(timeout=600)
    log.close()
    assert reference.returncode == 0, (tmp_path / "straight.log").read_text()[-3000:]
    records = read_metrics(killed)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert stable(records) == stable(read_metrics(straight))
    assert_same_weights(step_dir(straight, 6), step_dir(killed, 6))
    assert records[2]["stability/rolled_back_from"] == 5
    assert json.loads((killed / "rollbacks.json").read_text())[0]["status"] == "done"
    side = [json.loads(x) for x in (killed / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in side] == [3, 4, 5]
    (moved,) = (killed / "checkpoints" / "superseded").iterdir()
    assert moved.name.startswith("step_000004.")
    assert "rolled back from step 5 to step 2" in (moved / "SUPERSEDED.txt").read_text()


def damage(kind: str, ckpt: Path) -> str:
    """Damage `ckpt` one way; returns what the resume must report about it."""
    data = sorted(ckpt.glob("__*.distcp"))[0]
    if kind == "truncated":
        os.truncate(data, data.stat().st_size // 2)
        return f"{data.name}: truncated"
    if kind == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2 : len(raw) // 2 + 4096] = os.urandom(4096)
        data.write_bytes(bytes(raw))  # the same size: only the checksum can tell
        return f"{data.name}: checksum mismatch"
    if kind == "no_manifest":
        (ckpt / "manifest.json").unlink()
        return "manifest.json: missing"
    if kind == "no_dcp_metadata":
        (ckpt / ".metadata").unlink()
        return ".metadata: missing"
    if kind == "no_gspo_metadata":
        (ckpt / "gspo_checkpoint.json").unlink()
        return "gspo_checkpoint.json: missing"
    raise ValueError(kind)


EVERY_STEP_SAVED = ["trainer.save_every=1", "trainer.keep_last=5"]


@pytest.fixture(scope="module")
def five_saved_steps(tmp_path_factory) -> Path:
    """A run of 5 steps with a checkpoint after each, all kept. Tests damage or resume copies of
    it (`copy_run`): one run instead of one per test, each start of gspo-train costs seconds."""
    run = tmp_path_factory.mktemp("five_saved_steps") / "run"
    train(run, "trainer.steps=5", *EVERY_STEP_SAVED)
    return run


def copy_run(run: Path, target: Path) -> Path:
    shutil.copytree(run, target)
    return target


def test_damaged_checkpoints_are_named_and_skipped_together(five_saved_steps, tmp_path):
    """Five checkpoints, the newest four damaged in four ways: the resume names each problem,
    moves them aside, resumes from the intact one and retrains from there."""
    run = copy_run(five_saved_steps, tmp_path / "run")
    expected = {
        5: damage("truncated", step_dir(run, 5)),
        4: damage("flipped", step_dir(run, 4)),
        3: damage("no_manifest", step_dir(run, 3)),
        2: damage("no_dcp_metadata", step_dir(run, 2)),
    }
    proc = train(run, "trainer.steps=6", *EVERY_STEP_SAVED)
    for step, fragment in expected.items():
        line = next(x for x in proc.stderr.splitlines() if f"step_{step:06d} is unusable" in x)
        assert fragment in line, (fragment, line)
    assert "resumed at step 1" in proc.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert len((run / "metrics.superseded.jsonl").read_text().splitlines()) == 4
    moved = sorted((run / "checkpoints" / "superseded").iterdir())
    assert [p.name.split(".")[0] for p in moved] == [f"step_{s:06d}" for s in (2, 3, 4, 5)]
    assert all("SUPERSEDED.txt" in {f.name for f in p.iterdir()} for p in moved)


def test_no_usable_checkpoint_stops_the_run_and_loads_nothing(tmp_path):
    run = tmp_path / "run"
    train(run, "trainer.steps=2", "trainer.save_every=1")
    damage("flipped", step_dir(run, 2))
    damage("no_gspo_metadata", step_dir(run, 1))
    records = (run / "metrics.jsonl").read_text()
    proc = train(run, "trainer.steps=3", "trainer.save_every=1", expect="failure")
    assert "holds 2 checkpoint(s) and none is usable" in proc.stderr
    assert "checksum mismatch" in proc.stderr and "gspo_checkpoint.json: missing" in proc.stderr
    assert "starting from step 0" not in proc.stderr
    assert (run / "metrics.jsonl").read_text() == records  # nothing rewritten
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]


def test_resume_never_refuses_a_directory_with_checkpoints(five_saved_steps, tmp_path):
    run = copy_run(five_saved_steps, tmp_path / "run")
    proc = train(run, "trainer.steps=2", "trainer.resume=never", expect="failure")
    assert "trainer.resume=never" in proc.stderr and "holds checkpoints" in proc.stderr
    proc = train(run, "trainer.steps=2", "trainer.resume=atuo", expect="failure")
    assert "trainer.resume='atuo' is not auto, never, or a checkpoint directory" in proc.stderr


def test_longer_schedule_on_resume_matches_a_run_configured_so_from_the_start(tmp_path):
    """Linear decay over 4 steps, then resumed with 8: steps 5-8 get the LR that a run of 8
    steps has there (the schedule is a function of the optimizer step and the current
    config; megatron's scheduler load would have added steps and kept the old length)."""
    sched = ["optimizer.decay_style=linear", "trainer.save_every=0"]
    short, full = tmp_path / "short", tmp_path / "full"
    train(short, "trainer.steps=4", *sched)
    train(short, "trainer.steps=8", *sched)
    train(full, "trainer.steps=8", *sched)
    lr_resumed = [r["actor/lr"] for r in read_metrics(short)]
    lr_full = [r["actor/lr"] for r in read_metrics(full)]
    assert lr_resumed[4:] == lr_full[4:]
    assert all(lr > 0 for lr in lr_full[:7])  # the old behaviour gave 0 from step 5


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` at `path` (root only); yields False where mounting is not allowed."""
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    try:
        yield mounted.returncode == 0
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_is_named_and_keeps_the_last_checkpoint(tmp_path):
    """The second checkpoint does not fit: the run stops with the OS's reason, the file, and
    the intact checkpoint; nothing half-written is left."""
    one_checkpoint = 2.6e6  # tiny_moe with Adam state, measured
    with small_filesystem(tmp_path / "disk", f"{int(1.5 * one_checkpoint)}") as real:
        run = tmp_path / "disk" / "run"
        faults = None if real else "enospc_in_save=2"  # no tmpfs here: the same error, injected
        proc = train(run, "trainer.steps=3", "trainer.save_every=1", faults=faults,
                     expect="failure")  # fmt: skip
        assert "No space left on device" in proc.stderr, proc.stderr[-3000:]
        assert "step_000002.tmp-" in proc.stderr  # the file (or directory) being written
        assert "The newest intact checkpoint is" in proc.stderr and "step_000001" in proc.stderr
        assert not list((run / "checkpoints").glob("*.tmp-*"))
        assert manifest.verify(step_dir(run, 1)) == []
        assert [r["step"] for r in read_metrics(run)] == [1, 2]


class _RunsCode:
    """Unpickling this creates a marker file: a stand-in for any code in a crafted checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def crafted_checkpoint(source: Path, target: Path, marker: Path) -> Path:
    """A copy of `source` whose DCP metadata runs code when unpickled, with the manifest
    updated to match (an attacker would), so only the restricted unpickler stands in the way."""
    shutil.copytree(source, target)
    with open(target / ".metadata", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    entries = manifest.read_manifest(target)
    entries[".metadata"] = manifest.file_digest(target / ".metadata")
    manifest.write_manifest(target, entries)
    return target


def test_crafted_checkpoint_runs_no_code_at_any_entry_point(five_saved_steps, tmp_path):
    marker = tmp_path / "code_ran"
    crafted = crafted_checkpoint(step_dir(five_saved_steps, 1), tmp_path / "crafted", marker)
    env = gspo_train_env()
    entry_points = {
        "model.init_from": lambda: train(tmp_path / "a", f"model.init_from={crafted}",
                                         expect="failure"),
        "trainer.resume": lambda: train(tmp_path / "b", f"trainer.resume={crafted}",
                                        expect="failure"),
        "convert_megatron_to_hf": lambda: subprocess.run(
            [sys.executable, "tools/convert_megatron_to_hf.py", "--megatron-path", str(crafted),
             "--output", str(tmp_path / "hf")],
            capture_output=True, text=True, env=env, cwd=REPO,
        ),
        "gspo-logprobs": lambda: subprocess.run(
            [sys.executable, "-m", "gspo_megatron.logprobs_cli", "--checkpoint",
             str(crafted), "--input", str(write_sequences(tmp_path / "seq.jsonl")),
             "--output", str(tmp_path / "lp.jsonl")],
            capture_output=True, text=True, env=env, cwd=REPO,
        ),
    }  # fmt: skip
    for name, run_it in entry_points.items():
        proc = run_it()
        assert proc.returncode != 0, name
        assert "refuses to load posix.system" in proc.stderr, (name, proc.stderr[-2000:])
        assert not marker.exists(), f"{name} ran the checkpoint's code"


def write_sequences(path: Path) -> Path:
    path.write_text(json.dumps({"input_ids": [1, 5, 6, 7]}) + "\n")
    return path


def test_ppo_critic_is_saved_resumed_bitwise_and_verified_with_the_policy(tmp_path):
    """PPO: the critic is saved in every checkpoint (`critic/`, under the one manifest). A run
    killed in step 3 and resumed ends with the records, policy and critic weights of an
    uninterrupted run; a damaged critic file makes its checkpoint unusable like a damaged
    policy file; a checkpoint without a critic is refused for a PPO resume, naming why."""
    common = ["algorithm=ppo", "trainer.steps=4", "trainer.save_every=2", "seed=3"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(straight, *common)
    train(killed, *common, faults="kill_after_optimizer_step=10", expect="killed")
    proc = train(killed, *common)
    assert "resumed at step 2" in proc.stderr
    assert stable(read_metrics(killed)) == stable(read_metrics(straight))
    for part in ("", "critic"):
        assert_same_weights(step_dir(straight, 4) / part, step_dir(killed, 4) / part)
    critic = checkpoint_tensors(step_dir(killed, 4) / "critic")
    assert critic["output_layer.weight"].shape[0] == 1  # the value head
    assert json.loads((step_dir(killed, 4) / "critic" / "gspo_checkpoint.json").read_text())[
        "value_head"
    ]
    listed = manifest.read_manifest(step_dir(killed, 4))
    assert any(name.startswith("critic/") for name in listed)

    data = sorted((step_dir(killed, 4) / "critic").glob("__*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 1024] = os.urandom(1024)
    data.write_bytes(bytes(raw))
    proc = train(killed, *common[:1], "trainer.steps=5", "trainer.save_every=2", "seed=3")
    line = next(x for x in proc.stderr.splitlines() if "step_000004 is unusable" in x)
    assert f"critic/{data.name}: checksum mismatch" in line
    assert "resumed at step 2" in proc.stderr

    policy_only = tmp_path / "grpo"
    train(policy_only, "algorithm=grpo", "trainer.steps=1", "seed=3")
    proc = train(
        tmp_path / "from_grpo", *common[:1], "trainer.steps=2",
        f"trainer.resume={step_dir(policy_only, 1)}", expect="failure",
    )  # fmt: skip
    assert "holds no critic (critic/), which this run trains" in proc.stderr
