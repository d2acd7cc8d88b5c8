"""The GPU check: the one-GPU suite's checks, then training-step MFU and rollout tokens/s.

    python benchmarks/gpu_check.py --wheelhouse .whl     # on one GPU (e.g. one H200); a table
    python benchmarks/gpu_check.py --json gpu_check.json # also write every figure as JSON
    python benchmarks/gpu_check.py --checks none         # the performance figures only

One command on a machine with torch + CUDA and no network: when megatron-core or another
runtime dependency is missing it runs `tools/install.sh --wheelhouse DIR` (wheels from
`tools/make_wheelhouse.sh`; --wheelhouse defaults to ./wheels next to this script);
gspo_megatron is used from this checkout. Exit status 1 when a check fails. Meant to finish in
under 5 minutes on one H200; the table's header gives the wall time.

Checks (tests/gpu/gpu_worker.py, the same code `pytest -m gpu` runs; each in its own process):
train step, embedded generation vs recomputed log-probs, weight export, checkpoint round trip,
and bf16 log-probs on the GPU vs fp32 log-probs on the CPU (a CPU process with CUDA hidden
writes the reference). Tolerances and their reasons: tests/gpu/gpu_worker.py, docs/ENGINE.md.

What it measures, one process, random weights of conf/model/moe_1b.yaml (~1.6B parameters,
~0.3B active per token), in the preset's dtype (bf16), local (non-transformer-engine) layers
unless transformer-engine is importable:

1. train step: `TrainingEngine.train_step` with the GSPO loss (forward + backward + Adam on the
   distributed optimizer), --sequences sequences of --prompt-len + --response-len tokens, cut
   into micro-batches of --micro-batch-tokens; median over --steps timed steps after --warmup.
2. forward: `TrainingEngine.forward` on the same batch (the old-policy log-probs pass).
3. rollout: `EmbeddedEngine.generate`, --rollout-prompts prompts x --rollout-n samples,
   exactly --rollout-new-tokens new tokens each (no stop token), temperature 1. The engine
   prefills each distinct prompt once and copies its KV cache to the n samples; so does the
   FLOP count.

MFU = model FLOPs / (time x peak). Model FLOPs per token (forward) = 2 x active parameters
that multiply (attention projections, router, top-k experts, output layer; not the embedding
lookup) + attention scores 4 x layers x context x heads x head_dim, with the causal mean context
for training and the running context for decoding; training counts 3x the forward (backward =
2x) and no recomputation. Peak: --peak-tflops, else the device's dense bf16 peak from a small
table (H200/H100 SXM 989, A100 312); the log-prob/entropy arithmetic of the loss is not counted.
--allow-cpu runs the same code on CPU (with a small --preset, for checking the script itself;
the checks then run in bf16 on CPU).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Dense bf16 tensor-core peaks (no sparsity), TFLOPS, by a substring of the device name.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.0}


# What the checks and the measurement import besides torch (gspo_megatron's runtime needs).
NEEDED = ("megatron.core", "transformers", "safetensors", "yaml", "psutil", "tqdm", "hydra")
WORKER = REPO / "tests" / "gpu" / "gpu_worker.py"
CHECKS = "train,generate,export,checkpoint,offload,logprobs"


def ensure_installed(wheelhouse: Path) -> str:
    """Install the package offline from `wheelhouse` when a runtime dependency is missing."""
    missing = [name for name in NEEDED if not _importable(name)]
    if not missing:
        return "already installed"
    if not wheelhouse.is_dir():
        raise SystemExit(
            f"gpu_check: {', '.join(missing)} not importable and no wheelhouse at {wheelhouse}; "
            "make one with tools/make_wheelhouse.sh and pass --wheelhouse DIR"
        )
    env = dict(os.environ, PYTHON=sys.executable)
    cmd = ["bash", str(REPO / "tools" / "install.sh"), "--wheelhouse", str(wheelhouse)]
    subprocess.run(cmd, check=True, env=env)
    importlib.invalidate_caches()
    return f"installed from {wheelhouse} (missing: {', '.join(missing)})"


def _importable(name: str) -> bool:
    # find_spec("megatron.core") imports only its parent package, not megatron.core itself
    # (whose import needs gspo_megatron's shims on CPU).
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def run_checks(names: list[str], allow_cpu: bool, workdir: Path) -> tuple[list[dict], str]:
    """The suite's checks in worker processes: (JSON rows, output tail of failed workers)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    args = ["--checks", ",".join(names)] + (["--allow-cpu"] if allow_cpu else [])
    steps = []
    if "logprobs" in names:
        reference = workdir / "cpu_reference"
        hidden = dict(env, CUDA_VISIBLE_DEVICES="")  # an fp32 reference from the CPU
        steps.append(("cpu reference", ["--cpu-reference", str(reference)], hidden))
        args += ["--reference", str(reference)]
    steps.append(("checks", args, env))
    rows: list[dict] = []
    errors = ""
    for label, step_args, step_env in steps:
        cmd = [sys.executable, str(WORKER), *step_args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=step_env, timeout=420)
        except subprocess.TimeoutExpired as err:  # a hang must not cost the table
            proc = subprocess.CompletedProcess(cmd, 124, _text(err.stdout), _text(err.stderr))
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"check"')]
        rows += lines
        if proc.returncode != 0:
            errors += f"--- {label} exited {proc.returncode}:\n{proc.stderr[-3000:]}\n"
            if not lines:
                rows.append(
                    {"check": f"{label}/ran", "value": proc.returncode, "tol": None, "ok": False,
                     "detail": "no result; its output follows the table"}
                )  # fmt: skip
    return rows, errors


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def active_matmul_params(cfg) -> dict[str, int]:
    """Parameters that multiply each token's activations, by part (top-k experts only)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    attention = layers * (h * q + 2 * h * kv + q * h)
    moe_layers = [
        i
        for i in range(layers)
        if cfg.model_type == "qwen3_moe"
        and i not in cfg.mlp_only_layers
        and (i + 1) % cfg.decoder_sparse_step == 0
    ]
    dense_layers = layers - len(moe_layers)
    mlp = len(moe_layers) * (
        h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    )
    mlp += dense_layers * 3 * h * cfg.intermediate_size
    return {"attention": attention, "mlp": mlp, "output": h * cfg.vocab_size}


def forward_flops_per_token(cfg, context: float) -> float:
    """Forward FLOPs of one token attending to `context` tokens."""
    matmul = 2 * sum(active_matmul_params(cfg).values())
    scores = 4 * cfg.num_hidden_layers * context * cfg.num_attention_heads * cfg.head_dim
    return matmul + scores


def peak_flops(device_name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="moe_1b")
    parser.add_argument(
        "--wheelhouse",
        "--wheels",
        type=Path,
        default=Path(__file__).resolve().parent / "wheels",
        help="wheels from tools/make_wheelhouse.sh, installed when a dependency is missing",
    )
    parser.add_argument("--checks", default=CHECKS, help=f"some of {CHECKS}, or none")
    parser.add_argument("--sequences", type=int, default=64, help="sequences per train step")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=1536)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=5, help="timed train steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rollout-prompts", type=int, default=64)
    parser.add_argument("--rollout-n", type=int, default=8)
    parser.add_argument("--rollout-prompt-len", type=int, default=128)
    parser.add_argument("--rollout-new-tokens", type=int, default=256)
    parser.add_argument("--rollout-batch-tokens", type=int, default=262144)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (checking)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: no CUDA device (pass --allow-cpu to check the script on CPU)")
        return 2
    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    install_note = ensure_installed(args.wheelhouse)
    names = [c for c in args.checks.split(",") if c and c != "none"]
    checks, errors = [], ""
    if names:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as workdir:
            checks, errors = run_checks(names, args.allow_cpu, Path(workdir))
    checks_seconds = time.perf_counter() - started

    # The performance figures run in this process, after the checks' processes have ended.
    perf_info, results = {}, {}
    try:
        perf_info, results = measure(args, device_name)
    except Exception as err:  # still print the checks' table
        errors += f"--- performance measurement raised:\n{traceback.format_exc()[-3000:]}"
        checks.append(
            {"check": "performance/ran", "value": float("nan"), "tol": None, "ok": False,
             "detail": f"{type(err).__name__}: {err}"}
        )  # fmt: skip
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": device_name,
        "torch": torch.__version__,
        "megatron": install_note,
        "wall_seconds": time.perf_counter() - started,
        "checks_seconds": checks_seconds,
        **perf_info,
    }
    _print(info, checks, results)
    if errors:
        print("\noutput of what failed:\n" + errors)
    if args.json:
        payload = {"info": info, "checks": checks, "results": results}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0 if all(c["ok"] for c in checks) else 1


def measure(args: argparse.Namespace, device_name: str) -> tuple[dict, dict]:
    """MFU of forward and train step, rollout tokens/s: (info, rows by phase)."""
    import torch

    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.loss import LossSettings
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.sample import TrainSample
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    cuda = torch.cuda.is_available()
    peak = peak_flops(device_name, args.peak_tflops)
    seq_len = args.prompt_len + args.response_len
    cfg = load_preset(args.preset)
    layout = ParallelLayout()
    parallel.initialize(layout, seed=0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    max_len = max(seq_len, args.rollout_prompt_len + args.rollout_new_tokens)
    engine = TrainingEngine(
        cfg,
        layout,
        EngineSettings(
            max_sequence_length=max_len, max_tokens_per_microbatch=args.micro_batch_tokens
        ),
        OptimizerSettings(lr=1e-6, weight_decay=0.0),
    )
    params = sum(p.numel() for m in engine.unwrapped_chunks for p in m.parameters())
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(4, cfg.vocab_size, (n,), generator=gen).tolist()

    samples = [
        TrainSample(
            prompt_ids=tokens(args.prompt_len),
            response_ids=tokens(args.response_len),
            advantage=float(torch.randn((), generator=gen)),
        )
        for _ in range(args.sequences)
    ]
    step_tokens = args.sequences * seq_len
    results: dict[str, dict] = {}

    # forward (old log-probs), also giving old_logprobs for the train step
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        started = time.perf_counter()
        out = engine.forward(samples)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    for s, lp in zip(samples, out.logprobs, strict=True):
        s.old_logprobs = [float(x) for x in lp]
    fwd_flops = forward_flops_per_token(cfg, context=(seq_len + 1) / 2) * step_tokens
    results["forward (old log-probs)"] = _row(times, step_tokens, fwd_flops, peak)

    # train step: GSPO loss, forward + backward + optimizer
    loss = LossSettings("gspo", {"clip_low": 3e-4, "clip_high": 4e-4})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, microbatches = [], 0.0
    for i in range(args.warmup + args.steps):
        sync()
        started = time.perf_counter()
        metrics = engine.train_step(samples, loss)
        sync()
        microbatches = metrics.get("num_microbatches", 0.0)
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    results["train step (GSPO, fwd+bwd+Adam)"] = _row(times, step_tokens, 3 * fwd_flops, peak)
    train_peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")

    # rollout: batched KV-cache decoding with the policy's own weights
    rollout = EmbeddedEngine(engine, max_batch_tokens=args.rollout_batch_tokens, seed=0)
    prompts = [tokens(args.rollout_prompt_len) for _ in range(args.rollout_prompts)]
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=args.rollout_new_tokens, stop_token_ids=(), seed=0
    )
    times, generated = [], 0
    for i in range(1 + max(1, args.steps // 2)):
        sync()
        started = time.perf_counter()
        groups = rollout.generate(prompts, args.rollout_n, sampling)
        sync()
        generated = sum(len(s.response_ids) for g in groups for s in g)
        if i >= 1:
            times.append(time.perf_counter() - started)
    p, r = args.rollout_prompt_len, args.rollout_new_tokens
    decode_flops = forward_flops_per_token(cfg, context=p + (r + 1) / 2) * generated
    # the engine prefills each distinct prompt once and copies its cache to the n samples
    prefill_flops = forward_flops_per_token(cfg, context=(p + 1) / 2) * p * len(prompts)
    results["rollout (embedded engine)"] = _row(
        times, generated, decode_flops + prefill_flops, peak
    )

    parts = active_matmul_params(cfg)
    info = {
        "preset": args.preset,
        "dtype": cfg.params_dtype,
        "parameters": params,
        "active_matmul_parameters": parts,
        "peak_tflops": peak / 1e12 if peak else None,
        "train_batch": f"{args.sequences} x ({args.prompt_len}+{args.response_len}) tokens, "
        f"{microbatches:.0f} micro-batches of <= {args.micro_batch_tokens} tokens",
        "rollout_batch": f"{args.rollout_prompts} prompts x {args.rollout_n} samples, "
        f"{p} prompt + {r} new tokens",
        "train_peak_memory_gib": train_peak_gib,
    }
    rollout.close()
    parallel.destroy()
    return info, results


def _row(times: list[float], tokens: int, flops: float, peak: float | None) -> dict:
    median = statistics.median(times)
    return {
        "median_s": median,
        "tokens": tokens,
        "tokens_per_s": tokens / median,
        "tflops": flops / median / 1e12,
        "mfu": flops / median / peak if peak else None,
        "runs": len(times),
    }


def _print(info: dict, checks: list[dict], results: dict) -> None:
    print(
        f"\ngpu_check {info['date']}  {info['device']}  torch {info['torch']}  "
        f"megatron-core: {info['megatron']}  ({info['wall_seconds']:.0f} s, checks "
        f"{info['checks_seconds']:.0f} s)"
    )
    if checks:
        print(f"\n{'check':<52} {'figure':>11} {'limit':>9}  result")
        for c in checks:
            value = c["value"]
            figure = f"{value:.3g}" if isinstance(value, float) else str(value)
            limit = f"<= {c['tol']:.3g}" if c.get("tol") is not None else ""
            result = "pass" if c["ok"] else "FAIL"
            print(f"{c['check']:<52} {figure:>11} {limit:>9}  {result}  {c.get('detail', '')}")
        failed = sum(not c["ok"] for c in checks)
        print(f"checks: {len(checks) - failed} passed, {failed} failed")
    if not results:
        return
    active = sum(info["active_matmul_parameters"].values())
    print(
        f"\npreset {info['preset']} ({info['dtype']}): {info['parameters'] / 1e6:,.1f}M "
        f"parameters, {active / 1e6:,.1f}M active matmul parameters per token (incl. output layer)"
    )
    print(f"train batch: {info['train_batch']}; rollout: {info['rollout_batch']}")
    print(f"{'phase':<34} {'median s':>9} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7}")
    for name, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(
            f"{name:<34} {r['median_s']:>9.3f} {r['tokens_per_s']:>12,.0f} "
            f"{r['tflops']:>9.2f} {mfu:>7}"
        )
    peak = info["peak_tflops"]
    print(
        f"peak used for MFU: {peak} TFLOPS (dense bf16); train peak memory "
        f"{info['train_peak_memory_gib']:.1f} GiB"
    )


if __name__ == "__main__":
    sys.exit(main())
