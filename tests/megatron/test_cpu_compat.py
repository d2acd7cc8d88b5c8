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


SAME_ARITHMETIC = r"""
import json, torch
from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel import layers

torch.manual_seed(0)
out = {}

# Linear layers: the plain matmul against megatron's autograd Function, outputs and gradients.
x, w, b, g = torch.randn(7, 3, 16), torch.randn(24, 16), torch.randn(24), torch.randn(7, 3, 24)
for name, bias in (("no_bias", None), ("bias", b)):
    results = []
    for fn in (
        lambda x, w, bias: layers.linear_with_grad_accumulation_and_async_allreduce(
            x, w, bias, False, False, False
        ),
        lambda x, w, bias: layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
            x, w, bias, False, False, False, None, 0, None, 1
        ),
    ):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, bias)
        y.backward(g)
        results.append([y, xi.grad, wi.grad])
    out[f"linear_{name}_bitwise"] = all(
        torch.equal(a, b) for a, b in zip(*results, strict=True)
    )
xi = x.clone().requires_grad_()
out["linear_plain_has_no_function_node"] = type(
    layers.linear_with_grad_accumulation_and_async_allreduce(xi, w, None, False, False, False)
    .grad_fn
).__name__

# THD RoPE: every token's frequencies gathered at once against megatron's per-sequence loop,
# without and with context parallelism (this rank's chunks r and 2cp-1-r of each sequence).
class Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank

per_sequence = rope_utils._apply_rotary_pos_emb_thd.__wrapped__
lengths = [4, 12, 8, 20, 4]
freqs = torch.randn(max(lengths), 1, 1, 16)
for cp in (1, 2):
    for rank in range(cp):
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        t = torch.randn(sum(lengths) // cp, 4, 16)
        group = Group(cp, rank)
        got = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group)
        want = per_sequence(t, cu, freqs, cp_group=group)
        out[f"rope_cp{cp}_rank{rank}_bitwise"] = bool(torch.equal(got, want))
print(json.dumps(out))
"""


def test_speed_shims_keep_megatrons_arithmetic_bitwise():
    """The shims that replace megatron's per-call Python (linear layers without TP, THD RoPE)
    give bitwise what megatron's own code gives."""
    proc = run(SAME_ARITHMETIC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("linear_plain_has_no_function_node") != "BackwardCFunction"
    assert got and all(got.values()), got
