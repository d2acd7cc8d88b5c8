"""Run worker scripts in subprocesses, under torchrun for several ranks.

megatron-core keeps its parallel state per process, so every test that builds a megatron model
runs it in a worker process and reads back the JSON lines the worker prints.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    base = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env = {**os.environ, **base, **(env or {})}
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            str(script),
            *args,
        ]
    else:
        cmd = [sys.executable, str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    failed = proc.returncode != 0
    if failed != expect_failure:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"{script} {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return lines
