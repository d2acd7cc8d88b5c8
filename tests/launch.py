"""Run worker scripts in subprocesses, under torchrun for several ranks.

megatron-core keeps its parallel state per process, so every test that builds a megatron model
runs it in a worker process and reads back the JSON lines the worker prints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.network import free_port

REPO = Path(__file__).resolve().parents[1]

# The tests that run SGLang's own request classes (tests/rollout/sglang_test_server.py)
needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None or importlib.util.find_spec("zmq") is None,
    reason="needs `pip install --no-deps sglang==0.5.23` and pyzmq (the test extra)",
)


def python_command(args: list[str], nproc: int = 1) -> list[str]:
    """`python ARGS`, or the same under torchrun with `nproc` processes on a free port."""
    if nproc == 1:
        return [sys.executable, *args]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", *args,
    ]  # fmt: skip


def run_worker(
    script: str | Path,
    args: list[str],
    nproc: int = 1,
    timeout: float = 600,
    expect_failure: bool = False,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Run a worker script (under torchrun when nproc > 1); return the JSON lines it printed.

    `env` adds to (or overrides) this process's environment. Fails the test with the worker's
    output when its exit status is not the expected one.
    """
    proc = start_worker(script, args, nproc=nproc, env=env)
    return finish_worker(proc, timeout=timeout, expect_failure=expect_failure)


def start_worker(
    script: str | Path, args: list[str], nproc: int = 1, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A worker started in the background (`finish_worker` collects it): workers that do not
    depend on each other run side by side on the machine's cores."""
    # tests/ for the helpers the workers share (layout_text.py)
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    base = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env = {**os.environ, **base, **(env or {})}
    cmd = python_command([str(script), *args], nproc=nproc)
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
    )


def finish_worker(
    proc: subprocess.Popen, timeout: float = 600, expect_failure: bool = False
) -> list[dict]:
    """The JSON lines a started worker printed, once it has exited as expected."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(proc.args)} ran past {timeout} s:\n{(stdout + stderr)[-6000:]}")
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    if (proc.returncode != 0) != expect_failure:
        tail = (stdout + stderr)[-6000:]
        pytest.fail(f"{' '.join(proc.args)} exited {proc.returncode}:\n{tail}")
    return lines


FAULT_INJECTOR = REPO / "tests" / "faults" / "inject"


def layouts_by_launch(worker: Path, layouts, base_args: list[str]):
    """checks(layout, nproc): a worker's result lines for one `--layout`, run at first need
    together with every layout of that process count, in one launch (process start-up is most
    of a small layout's time). `layouts`: (layout text, process count, test id) entries."""
    done: dict[tuple[str, int], list[dict]] = {}

    def checks(layout: str, nproc: int) -> list[dict]:
        if (layout, nproc) not in done:
            group = [text for text, n, _ in layouts if n == nproc]
            args = [*base_args, *(arg for text in group for arg in ("--layout", text))]
            results = run_worker(worker, args, nproc=nproc)
            for text in group:
                done[text, nproc] = [r for r in results if r["layout"] == text]
        return done[layout, nproc]

    return checks


# The smallest gspo-train run the fault tests start: 2 prompts x 4 responses of at most 4 tokens,
# no evaluation, no progress bar, no TensorBoard (add trainer.steps and the rest per test).
TINY_RUN = (
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
)


def gspo_train_command(run_dir: Path, overrides: list[str], nproc: int = 1) -> list[str]:
    """gspo-train (under gspo_megatron.torchrun for several ranks) with Hydra's run directory."""
    args = ["-m", "gspo_megatron.train", f"hydra.run.dir={run_dir}", *overrides]
    if nproc == 1:
        return [sys.executable, *args]
    return [
        sys.executable, "-m", "gspo_megatron.torchrun", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", *args,
    ]  # fmt: skip


def gspo_train_env(faults: str | None = None, fault_rank: int | None = None) -> dict[str, str]:
    """The environment of a gspo-train test run; `faults` arms tests/faults/inject."""
    # tests/ for the environments of multi-turn runs (envs/scripted_envs.py)
    paths = [str(REPO), str(REPO / "tests")] + ([] if faults is None else [str(FAULT_INJECTOR)])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"
    )
    env.pop("GSPO_FAULTS", None)
    if faults is not None:
        env["GSPO_FAULTS"] = faults
        if fault_rank is not None:
            env["GSPO_FAULT_RANK"] = str(fault_rank)
    return env


def gspo_train(
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    faults: str | None = None,
    fault_rank: int | None = None,
    expect: str = "success",
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run gspo-train to its end. `expect`: "success" (exit 0), "failure" (non-zero exit) or
    "killed" (SIGKILL by an injected fault: exit -9, or 1 from torchrun); anything else fails
    the test with the run's output."""
    proc = subprocess.run(
        gspo_train_command(run_dir, list(overrides), nproc),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=gspo_train_env(faults, fault_rank),
        cwd=REPO,
    )
    ok = {
        "success": proc.returncode == 0,
        "failure": proc.returncode not in (0, -9),
        "killed": proc.returncode == -9 or (nproc > 1 and proc.returncode != 0),
    }[expect]
    if not ok:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"gspo-train (expected {expect}) exited {proc.returncode}:\n{tail}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_tensors(path: Path) -> dict:
    """A checkpoint's model tensors, read with torch DCP (no megatron needed)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if hasattr(m, "size") and "optimizer" not in k and "extra_state" not in k
    }
    load(state, storage_reader=reader, no_dist=True)
    return state


def hf_policy(path: Path, *, reward_model: bool = False, **changes) -> Path:
    """A random Hugging Face Qwen3-MoE with the tiny_moe preset's architecture; with
    `reward_model`, a *ForSequenceClassification with one label (a random score head)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    from gspo_megatron.spec.model_config import load_preset

    hf = load_preset("tiny_moe", **changes).to_hf()
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    if not reward_model:
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        return path
    config.num_labels = 1
    config.pad_token_id = 0
    model = AutoModelForSequenceClassification.from_config(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, not ~0
    model.save_pretrained(path)
    return path
