"""gspo_megatron.slurm without a cluster: environment and rank logic, the preflight's messages,
the signal supervisor (with stand-in Slurm commands), the scripts outside Slurm, the examples'
dry runs, and shellcheck."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch import REPO

from gspo_megatron import slurm

SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
EXAMPLES = sorted((REPO / "slurm" / "examples").glob("*.sh"))


def hostnames(nodelist: str) -> list[str]:
    return {"n[1-2]": ["n1", "n2"], "r[7-8]": ["r7", "r8"], "n1": ["n1"]}[nodelist]


def test_allocation_from_environment():
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "q30b",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_GPUS_ON_NODE": "8",
    }
    alloc = slurm.Allocation.from_env(env, hostnames=hostnames)
    assert alloc == slurm.Allocation("42", "q30b", ("n1", "n2"), 8)
    assert alloc.world_size == 16
    # A heterogeneous job: component 0 trains, component 1 serves.
    het = {
        "SLURM_JOB_ID": "43",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "r[7-8]",
        "SLURM_GPUS_PER_NODE_HET_GROUP_0": "h100:8",
    }
    assert slurm.Allocation.from_env(het, het_group=0, hostnames=hostnames).world_size == 16
    assert slurm.sglang_urls(het, 1, 30000, hostnames=hostnames) == [
        "http://r7:30000",
        "http://r8:30000",
    ]


@pytest.mark.parametrize(
    "raw,count", [("8", 8), ("h100:8", 8), ("gpu:a100:4", 4), ("2(IDX:0-1)", 2)]
)
def test_gpu_counts(raw, count):
    assert slurm.gpus_per_node({"SLURM_GPUS_PER_NODE": raw}) == count


def test_missing_environment_is_explained():
    with pytest.raises(slurm.SlurmError, match="inside a Slurm job.*--dry-run"):
        slurm.Allocation.from_env({}, hostnames=hostnames)
    with pytest.raises(slurm.SlurmError, match="#SBATCH --gpus-per-node"):
        slurm.gpus_per_node({"SLURM_JOB_ID": "1"})
    with pytest.raises(slurm.SlurmError, match="not a GPU count"):
        slurm.gpus_per_node({"SLURM_GPUS_ON_NODE": "lots"})
    with pytest.raises(slurm.SlurmError, match="names 2 nodes but SLURM_JOB_NUM_NODES=3"):
        slurm.Allocation.from_env(
            {
                "SLURM_JOB_ID": "1",
                "SLURM_JOB_NODELIST": "n[1-2]",
                "SLURM_JOB_NUM_NODES": "3",
                "SLURM_GPUS_ON_NODE": "8",
            },
            hostnames=hostnames,
        )
    with pytest.raises(slurm.SlurmError, match="component 1 of a heterogeneous job"):
        slurm.sglang_urls({}, 1, 30000, hostnames=hostnames)


def test_node_launch():
    env = {
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_GPUS_ON_NODE": "8",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "20042",
    }
    node = slurm.NodeLaunch.from_env(env)
    argv = node.argv("py", ["model=qwen3_30b_a3b", "hydra.run.dir=/r"])
    assert argv == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nnodes=4",
        "--node-rank=2",
        "--nproc-per-node=8",
        "--master-addr=n1",
        "--master-port=20042",
        "-m",
        "gspo_megatron.train",
        "model=qwen3_30b_a3b",
        "hydra.run.dir=/r",
    ]
    with pytest.raises(slurm.SlurmError, match="MASTER_ADDR and MASTER_PORT"):
        slurm.NodeLaunch.from_env({**env, "MASTER_ADDR": ""})
    with pytest.raises(slurm.SlurmError, match="outside 0..3"):
        slurm.NodeLaunch.from_env({**env, "SLURM_NODEID": "4"})
    assert slurm.torchrun_environment(env)["PET_SIGNALS_TO_HANDLE"] == "SIGINT,SIGHUP,SIGQUIT"


def test_run_directory_is_stable_and_overridable():
    assert slurm.default_run_dir("my run/1", "77") == "outputs/slurm/my_run_1_77"
    assert slurm.with_run_dir(["a=1"], "outputs/slurm/x_7") == [
        "a=1",
        "hydra.run.dir=outputs/slurm/x_7",
    ]
    mine = ["hydra.run.dir=/scratch/run1", "a=1"]
    assert slurm.with_run_dir(mine, "outputs/slurm/x_7") == mine
    assert slurm.run_dir_of(mine) == "/scratch/run1"


def test_sglang_overrides():
    out = slurm.sglang_overrides(["model=qwen3_30b_a3b"], ["http://r7:30000"], "n1")
    assert out == [
        "model=qwen3_30b_a3b",
        "rollout=sglang",
        '++rollout.sglang.urls=["http://r7:30000"]',
        "++rollout.sglang.weight_sync=distributed",
        "++rollout.sglang.master_address=n1",
    ]
    kept = slurm.sglang_overrides(["rollout=sglang", "rollout.sglang.weight_sync=disk"], [], "n1")
    assert kept.count("rollout=sglang") == 1 and "rollout.sglang.weight_sync=disk" in kept
    with pytest.raises(slurm.SlurmError, match="rollout.sglang.urls is set by"):
        slurm.sglang_overrides(["+rollout.sglang.urls=[x]"], [], "n1")


def test_preflight_accepts_a_valid_config_and_composes_sglang_overrides(tmp_path):
    ok = slurm.preflight(
        ["parallel=ep2", f"hydra.run.dir={tmp_path}"], nodes=1, gpus_per_node=2, gpu_memory_gib=None
    )
    assert ok.ok, ok.text()
    assert "ep=2" in ok.text() and "new run" in ok.text() and "not checked" in ok.text()
    overrides = slurm.sglang_overrides(["parallel=ep2"], ["http://r7:30000"], "n1")
    ok = slurm.preflight(overrides, nodes=1, gpus_per_node=2, gpu_memory_gib=80.0)
    assert ok.ok, ok.text()
    assert "fits" in ok.text()


@pytest.mark.parametrize(
    "overrides,nodes,gpus,memory,message",
    [
        (
            ["parallel.tp=3"],
            1,
            2,
            None,
            "world size 2 is not divisible by parallel.tp*pp*cp = 3*1*1 = 3",
        ),
        (["parallel.ep=8"], 2, 8, None, "parallel.ep=8 must divide the model's 4 experts"),
        (["algorithm=nope"], 1, 1, None, "error: config:"),
        (["trainer.bogus=1"], 1, 1, None, "Could not override 'trainer.bogus'"),
        (
            [
                "rollout=sglang",
                "+rollout.sglang.urls=[http://r7:30000]",
                "+rollout.sglang.recovery_timeout_s=0",
            ],
            1,
            1,
            None,
            "error: config: rollout.sglang.recovery_timeout_s must be > 0, got 0",
        ),
        (
            ["rollout=sglang", "+rollout.sglang.launch=[{model_path:/m,prt:1}]"],
            1,
            1,
            None,
            "error: config: unknown config key rollout.sglang.launch[0].prt",
        ),
        (["model=qwen3_30b_a3b", "parallel.ep=4"], 1, 4, 79.6, "does not fit in 79.6 GiB per GPU"),
        (
            ["data=jsonl", "data.train_files=[/nonexistent/train.jsonl]"],
            1,
            1,
            None,
            "data.train_files entry /nonexistent/train.jsonl does not exist",
        ),
    ],
)
def test_preflight_refuses_bad_input_with_the_reason(overrides, nodes, gpus, memory, message):
    result = slurm.preflight(overrides, nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=memory)
    assert not result.ok
    assert message in result.text(), result.text()


def test_memory_check_can_be_waived_and_dry_run_only_notes_paths():
    big = ["model=qwen3_30b_a3b", "parallel.ep=4", "model.init_from=/nonexistent/hf"]
    waived = slurm.preflight(
        big, nodes=1, gpus_per_node=4, gpu_memory_gib=79.6, memory_check=False, check_inputs=False
    )
    assert waived.ok and "warning: the memory plan says it does not fit" in waived.text()
    assert "note (dry run, not an error here): model.init_from" in waived.text()


def test_cli_outside_slurm_and_dry_run(capsys):
    assert slurm.main(["preflight", "parallel=ep2"], env={}) == 2
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err
    assert slurm.main(["torchrun", "--run-dir", "x", "parallel=ep2"], env={}) == 2
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err
    dry = ["preflight", "--dry-run", "--gpus-per-node", "8", "--gpu-memory-gib", "79.6"]
    dry.append("model=qwen3_30b_a3b")
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    code = slurm.main(
        [*dry, "--nodes", "2", *layout, "parallel.ep=8", "engine.recompute_activations=true"],
        env={},
    )
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "-> fits" in out.out and "preflight ok" in out.out
    assert slurm.main([*dry, "--nodes", "1", *layout, "parallel.ep=2"], env={}) == 1
    out = capsys.readouterr()
    assert "DOES NOT FIT" in out.out and "preflight failed: no rank was started" in out.err


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_refuse_to_run_outside_slurm(script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(script), "parallel=ep2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "submit this script with sbatch" in proc.stderr


def _supervise(tmp_path: Path, job_state: str) -> tuple[int, str, str, list[str]]:
    """`supervise` with stand-in squeue/scancel/scontrol; the test sends the batch step SIGTERM.
    The stand-in scancel delivers the signal to the stand-in training step, as slurmstepd would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    pid_file = tmp_path / "step.pid"
    fake = {
        "squeue": 'echo "7.0|gspo-train"; echo "7.1|sglang"',
        "scancel": f'kill -TERM "$(cat {pid_file})"',
        "scontrol": f'[ "$1" = show ] && echo "JobId=7 JobName=x JobState={job_state} Reason=None"',
    }
    for name, body in fake.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{body}\nexit 0\n')
        path.chmod(0o755)
    step = tmp_path / "step.py"
    step.write_text(
        textwrap.dedent(f"""
        import os, signal, time
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        while not got:
            time.sleep(0.05)
        print("checkpointed", flush=True)
        """)
    )
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.slurm",
        "supervise",
        "--",
        sys.executable,
        str(step),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err, calls.read_text().splitlines()


def test_supervisor_passes_the_time_limit_warning_to_the_step_and_requeues(tmp_path):
    code, out, err, calls = _supervise(tmp_path, "RUNNING")
    assert code == 0, err
    assert "checkpointed" in out
    assert "scancel --signal=TERM 7.0" in calls  # the training step only, not the servers
    assert "scontrol requeue 7" in calls
    assert "requeueing job 7" in err


def test_supervisor_does_not_requeue_a_cancelled_job(tmp_path):
    code, out, err, calls = _supervise(tmp_path, "COMPLETING")
    assert code == 0 and "checkpointed" in out, err
    assert "scancel --signal=TERM 7.0" in calls
    assert not any(c.startswith("scontrol requeue") for c in calls)
    assert "no requeue" in err


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_fit_per_the_planner(example):
    env = {**os.environ, "GSPO_PYTHON": sys.executable}
    cmd = ["bash", str(example), "--dry-run"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> fits" in proc.stdout and "preflight ok" in proc.stdout


def test_the_disaggregated_example_runs_async_per_preflight():
    """Its asynchronous variant (the overrides its header gives) passes preflight; with tensor
    weight sync (colocated servers) it is refused, naming the key."""
    example = REPO / "slurm" / "examples" / "qwen3_30b_a3b_4nodes_disaggregated.sh"
    env = {**os.environ, "GSPO_PYTHON": sys.executable}
    run_async = ["bash", str(example), "--dry-run", "rollout.mode=async", "rollout.queue_batches=2",
                 "rollout.max_staleness=2"]  # fmt: skip
    proc = subprocess.run(run_async, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "preflight ok" in proc.stdout, proc.stdout + proc.stderr
    colocated = [*run_async, "++rollout.sglang.weight_sync=tensor"]
    proc = subprocess.run(colocated, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rollout.sglang.weight_sync=tensor with rollout.mode=async" in proc.stdout + proc.stderr


def test_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    files = [*SCRIPTS, *EXAMPLES]
    proc = subprocess.run(["shellcheck", *map(str, files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
