"""benchmarks/gpu_check.py is meant for one GPU; its --allow-cpu mode runs the same code path on a
tiny preset, and the GPU suite's checks in bf16 on CPU, so the prepared script is checked here (it
cannot be run on a GPU in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import REPO


def test_gpu_check_runs_on_cpu_with_a_tiny_preset(tmp_path):
    out = tmp_path / "mfu.json"
    cmd = [
        sys.executable,
        "benchmarks/gpu_check.py",
        "--allow-cpu",
        "--preset=tiny_moe",
        "--sequences=4",
        "--prompt-len=8",
        "--response-len=8",
        "--micro-batch-tokens=32",
        "--steps=1",
        "--warmup=1",
        "--rollout-prompts=2",
        "--rollout-n=2",
        "--rollout-prompt-len=4",
        "--rollout-new-tokens=4",
        "--peak-tflops=1",
        f"--json={out}",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    rows = result["results"]
    assert set(rows) == {
        "forward (old log-probs)",
        "train step (GSPO, fwd+bwd+Adam)",
        "rollout (embedded engine)",
    }
    assert rows["rollout (embedded engine)"]["tokens"] == 2 * 2 * 4  # no stop token: all 4 each
    assert rows["train step (GSPO, fwd+bwd+Adam)"]["tokens"] == 4 * 16
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert "2 micro-batches" in result["info"]["train_batch"]
    assert "MFU" in proc.stdout
    # the suite's checks (tests/gpu/gpu_worker.py) ran and passed in bf16 on CPU
    checks = {c["check"]: c for c in result["checks"]}
    for prefix in ("train/", "generate[torch]/", "generate[megatron]/", "export/", "checkpoint/",
                   "offload/"):  # fmt: skip
        assert any(name.startswith(prefix) for name in checks), (prefix, sorted(checks))
    assert checks["logprobs/bf16_vs_cpu_fp32_max"]["tol"] == 0.1
    assert all(c["ok"] for c in checks.values()), [c for c in checks.values() if not c["ok"]]
    assert "checks: " in proc.stdout and " 0 failed" in proc.stdout


def test_flop_count_of_moe_1b():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from gspo_megatron.spec.model_config import load_preset

    cfg = load_preset("moe_1b")
    parts = gpu_check.active_matmul_params(cfg)
    # 16 layers x (q 1024x1024 + k,v 1024x256 + o 1024x1024); router + 4 of 32 experts (3 matrices
    # 1024x512); output layer 1024 x 151936.
    assert parts["attention"] == 16 * (2 * 1024 * 1024 + 2 * 1024 * 256)
    assert parts["mlp"] == 16 * (1024 * 32 + 4 * 3 * 1024 * 512)
    assert parts["output"] == 1024 * 151936
    scores = 4 * 16 * 100 * 16 * 64
    assert gpu_check.forward_flops_per_token(cfg, 100) == 2 * sum(parts.values()) + scores
