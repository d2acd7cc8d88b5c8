"""The project's real sbatch scripts on a real (one-node, localhost) Slurm cluster.

Each job runs the tiny CPU configuration as 2 ranks over gloo (the node advertises two stand-in
GPUs, so the scripts' --gpus-per-node logic is exercised unchanged). One story covers what a
user meets: a run, preemption by SIGTERM to the job's steps (`scancel --signal=TERM`), a
resubmission that continues the run, then SIGTERM to the batch script (what
`--signal=B:TERM@120` sends before the time limit), which checkpoints and requeues the job, which
resumes in the same run directory and completes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import REPO

TINY = [
    "parallel=ep2",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "logging.progress=false",
    "logging.tensorboard=false",
    "eval.every=0",
]
# The scripts ask for 64 CPUs and whole nodes; this node has 2 CPUs (one per rank).
SMALL_NODE = ["--nodes=1", "--gpus-per-node=2", "--cpus-per-task=2", "--time=15"]
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _env(cluster, **extra: str) -> dict[str, str]:
    return {
        **cluster.env,
        "GSPO_PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def sbatch(
    cluster, script: str, out: Path, *overrides: str, args: tuple[str, ...] = (), **env: str
) -> str:
    cmd = ["sbatch", "--parsable", f"--output={out}", *SMALL_NODE, *args, script, *overrides]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(cluster, **env), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job(cluster, job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_for(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")


def wait_finished(cluster, job_id: str, log: Path, timeout: float = 240) -> dict[str, str]:
    wait_for(
        lambda: job(cluster, job_id).get("JobState") in FINISHED,
        timeout,
        f"job {job_id} to finish",
        log,
    )
    return job(cluster, job_id)


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def scancel(cluster, *args: str) -> None:
    subprocess.run(["scancel", *args], env=cluster.env, check=True, timeout=60)


def test_run_preempt_resubmit_and_requeue(slurm, tmp_path):
    root = tmp_path / "runs"

    # 1. slurm/train.sbatch, default run directory <GSPO_RUN_ROOT>/<job name>_<job id>.
    log1 = tmp_path / "job1.out"
    j1 = sbatch(
        slurm,
        "slurm/train.sbatch",
        log1,
        *TINY,
        "trainer.steps=300",
        args=("--job-name=e2e",),
        GSPO_RUN_ROOT=str(root),
    )
    run = root / f"e2e_{j1}"
    wait_for(lambda: len(metrics(run)) >= 2, 240, "two training steps", log1)
    # Preemption: SIGTERM to every process of the job's steps (the ranks among them).
    scancel(slurm, "--signal=TERM", j1)
    state = wait_finished(slurm, j1, log1)
    out1 = log1.read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out1[-4000:]
    k = len(metrics(run))
    assert 2 <= k < 300
    assert (run / "checkpoints" / f"step_{k:06d}" / "gspo_checkpoint.json").is_file()
    assert "signal SIGTERM: checkpointing after this step" in out1
    # Both ranks took part: one torchrun on the node with 2 ranks, one checkpoint shard each.
    assert "--nnodes=1 --node-rank=0 --nproc-per-node=2 --master-addr=localhost" in out1
    assert "world=2" in out1
    shards = sorted(p.name for p in (run / "checkpoints" / f"step_{k:06d}").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]

    # 2. A new job continues the run (its hydra.run.dir) to k + 10 steps ...
    total = k + 10
    log2 = tmp_path / "job2.out"
    j2 = sbatch(
        slurm,
        "slurm/train.sbatch",
        log2,
        *TINY,
        f"trainer.steps={total}",
        f"hydra.run.dir={run}",
        args=("--job-name=e2e",),
    )
    wait_for(lambda: len(metrics(run)) >= k + 1, 240, "the resumed run's first step", log2)
    # ... and gets SIGTERM in its batch script, as --signal=B:TERM@120 sends it before the time
    # limit: the supervisor passes it to the training step, which checkpoints; then the job is
    # requeued (same job id, same run directory).
    scancel(slurm, "--batch", "--signal=TERM", j2)
    wait_for(
        lambda: (
            job(slurm, j2).get("Restarts") == "1" and job(slurm, j2).get("JobState") == "PENDING"
        ),
        120,
        "the job to be requeued",
        log2,
    )
    m = len(metrics(run))
    assert k < m < total, "the requeue came after the run had finished; raise the step margin"
    assert (run / "checkpoints" / f"step_{m:06d}" / "gspo_checkpoint.json").is_file()
    # Slurm holds a requeued job for ~2 minutes; release it (after the old credential's second).
    time.sleep(2)
    subprocess.run(
        ["scontrol", "update", f"jobid={j2}", "StartTime=now"],
        env=slurm.env,
        check=True,
        timeout=60,
    )
    state = wait_finished(slurm, j2, log2)
    out2 = log2.read_text()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        out2[-4000:]
    )
    assert f"resumed at step {k}" in out2 and f"resumed at step {m}" in out2
    assert f"requeueing job {j2}" in out2
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, total + 1))
    assert all(isinstance(r["reward/mean"], float) for r in records)
    final = run / "checkpoints" / f"step_{total:06d}"
    assert (final / "gspo_checkpoint.json").is_file()
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize(
    "override,env,message",
    [
        ("parallel.ep=3", {}, "world size 2 is not divisible by parallel.etp*ep*pp"),
        # GPUs of 1 GiB: the plan's fixed overhead alone is larger.
        ("parallel.ep=2", {"GSPO_GPU_MEMORY_GIB": "1"}, "does not fit in 1.0 GiB per GPU"),
    ],
    ids=["layout", "memory"],
)
def test_bad_input_fails_before_any_rank_starts(slurm, tmp_path, override, env, message):
    log = tmp_path / "bad.out"
    run = tmp_path / "run"
    j = sbatch(
        slurm, "slurm/train_1node.sbatch", log, *TINY, override, f"hydra.run.dir={run}", **env
    )
    state = wait_finished(slurm, j, log, timeout=120)
    out = log.read_text()
    assert state["JobState"] == "FAILED", out
    assert message in out
    assert "preflight failed: no rank was started" in out
    assert "torch.distributed.run" not in out and not run.exists()


def test_hydra_sweep_submits_one_job_per_run(slurm, tmp_path):
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher",
        reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]')",
    )
    # submitit polls sacct, which needs an accounting database this cluster does not have.
    shim = tmp_path / "bin" / "sacct"
    shim.parent.mkdir()
    shim.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).parent}/sacct_shim.py" "$@"\n'
    )
    shim.chmod(0o755)
    env = _env(slurm, PATH=f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        "-m",
        "algorithm=gspo,grpo",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={sweep}",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=10",
        "trainer.steps=1",
        *[o for o in TINY if not o.startswith("parallel")],
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    losses = {}
    for k in ("0", "1"):
        assert len(metrics(sweep / k)) == 1, k
        losses[k] = json.loads((sweep / k / "run_config.json").read_text())["algorithm"]["loss"]
    assert losses == {"0": "gspo", "1": "grpo"}
    job_dirs = list((sweep / ".submitit").iterdir())
    assert len(job_dirs) >= 2  # one Slurm job (array task) per run
