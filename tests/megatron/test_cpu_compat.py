"""The CPU/gloo compatibility module: what it installs, when, and its version check."""

from __future__ import annotations

import subprocess
import sys

from launch import REPO

PROBE = r"""
import json, sys, torch
from gspo_megatron.megatron import cpu_compat

assert "megatron.core" not in sys.modules  # importing the package loads no megatron
cpu_compat.apply()
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.optimizer import distrib_optimizer
print(json.dumps({
    "current_device": str(torch.cuda.current_device()),
    "stream_is_null": type(torch.cuda.Stream()).__name__,
    "schedules_cpu_zeros": str(schedules.torch.zeros([], device="cuda").device),
    "tensor_cuda_is_identity": torch.ones(2).cuda().device.type,
    "rng_fork_uses_cpu_state": bool(torch.equal(tp_random._get_cuda_rng_state(),
                                                torch.get_rng_state())),
    "split_sizes_numpy": type(token_dispatcher.maybe_move_tensor_to_cpu(
        torch.tensor([1, 2]), as_numpy=True)).__name__,
    "optimizer_fix": bool(getattr(distrib_optimizer.DistributedOptimizer, "_gspo_fixed", False)),
}))
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_shims_installed_on_cpu():
    proc = run(PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "current_device": "cpu",
        "stream_is_null": "_NullStream",
        "schedules_cpu_zeros": "cpu",
        "tensor_cuda_is_identity": "cpu",
        "rng_fork_uses_cpu_state": True,
        "split_sizes_numpy": "ndarray",
        "optimizer_fix": True,
    }


def test_wrong_megatron_version_is_refused():
    code = (
        "import importlib.metadata as m; real = m.version\n"
        "m.version = lambda name: '0.18.0' if name == 'megatron-core' else real(name)\n"
        "from gspo_megatron.megatron import cpu_compat\n"
        "cpu_compat.apply()\n"
    )
    proc = run(code)
    assert proc.returncode != 0
    assert "needs megatron-core==0.19.2" in proc.stderr and "found 0.18.0" in proc.stderr


def test_apply_after_megatron_import_is_refused():
    code = (
        "import sys, types\n"
        "sys.modules['megatron.core'] = types.ModuleType('megatron.core')  # imported earlier\n"
        "from gspo_megatron.megatron import cpu_compat\n"
        "cpu_compat.apply()\n"
    )
    proc = run(code)
    assert proc.returncode != 0
    assert "must run before megatron.core is imported" in proc.stderr


def test_megatron_import_before_apply_is_refused_naming_the_fix():
    """Importing the package applies nothing; megatron-core imported before `apply()` is an
    error that says what to call."""
    code = (
        "import sys\n"
        "import gspo_megatron.megatron, gspo_megatron.config, gspo_megatron.trainer\n"
        "import torch\n"
        "assert torch.cuda.current_device.__module__ != 'gspo_megatron.megatron.cpu_compat'\n"
        "import megatron.core\n"
    )
    proc = run(code)
    assert proc.returncode != 0
    assert "megatron.core is imported before gspo_megatron.megatron.cpu_compat.apply()" in (
        proc.stderr
    )
