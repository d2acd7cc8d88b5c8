"""Checkpoint conversion throughput and peak memory vs a plain safetensors load + save.

    python benchmarks/bench_convert.py [--gb 2.0] [--workdir DIR] [--keep]

Builds a synthetic Qwen3-MoE HF checkpoint of about --gb gigabytes (bf16, random values, several
shards), then runs, each in a fresh process so peak memory is its own:

  plain        safetensors.torch.load_file of every shard + save_file of the same tensors
  hf->megatron gspo_megatron.checkpoint.convert_hf_to_megatron
  megatron->hf gspo_megatron.checkpoint.convert_megatron_to_hf (then checked bitwise)

and prints GB/s (bytes written / wall time, fsync included everywhere) and peak RSS (above the
process's RSS before the step, imports excluded) side by side, with ratios to the plain copy.
Source files are in the page cache for every step (they were just written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def synthetic_config(target_gb: float) -> dict:
    """A Qwen3-MoE shape whose bf16 weights take about target_gb."""
    hidden, inter, experts, vocab, heads, kv, head_dim = 1024, 768, 56, 32000, 16, 4, 64
    per_layer = 3 * hidden * inter * experts + hidden * (heads + 2 * kv) * head_dim * 2
    layers = max(1, round((target_gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 3072,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": inter,
        "norm_topk_prob": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def make_synthetic(out: Path, target_gb: float) -> int:
    import torch

    from gspo_megatron.checkpoint.hf_io import ShardedSafetensorsWriter
    from gspo_megatron.checkpoint.mapping import get_mapping
    from gspo_megatron.spec.model_config import ModelConfig

    config = synthetic_config(target_gb)
    cfg = ModelConfig.from_hf(config)
    mapping = get_mapping(cfg)
    plan = [
        (name, torch.bfloat16, shape)
        for e in mapping.entries
        for name, shape in zip(e.hf_names, e.hf_shapes, strict=True)
    ]
    out.mkdir(parents=True)
    writer = ShardedSafetensorsWriter(out, plan, max_shard_bytes=500_000_000)
    gen = torch.Generator().manual_seed(0)
    for name, dtype, shape in plan:
        writer.write(name, (torch.randn(shape, generator=gen) * 0.02).to(dtype))
    writer.close()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return writer.total_bytes


# -- steps, each run in its own process --------------------------------------------------------


def step_plain(src: Path, dst: Path) -> dict:
    from safetensors.torch import load_file, save_file

    from gspo_megatron.checkpoint.convert import PeakRSS

    files = sorted(src.glob("*.safetensors"))
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        dst.mkdir()
        tensors = {}
        for f in files:
            tensors[f.name] = load_file(f)
        for name, part in tensors.items():
            save_file(part, dst / name, metadata={"format": "pt"})
            with open(dst / name, "rb+") as fh:
                os.fsync(fh.fileno())
        seconds = time.perf_counter() - t0
    written = sum(f.stat().st_size for f in dst.iterdir())
    return {"seconds": seconds, "bytes": written, "peak": mem.peak, "before": mem.before}


def step_hf_to_megatron(src: Path, dst: Path) -> dict:
    from transformers import AutoConfig  # noqa: F401 - imported before the clock starts

    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    r = convert_hf_to_megatron(src, dst)
    return {
        "seconds": r.seconds,
        "bytes": r.bytes_written,
        "peak": r.peak_rss,
        "before": r.rss_before,
        "largest": r.largest_tensor_bytes,
    }


def step_megatron_to_hf(src: Path, dst: Path) -> dict:
    from gspo_megatron.checkpoint.convert import convert_megatron_to_hf

    r = convert_megatron_to_hf(src, dst)
    return {
        "seconds": r.seconds,
        "bytes": r.bytes_written,
        "peak": r.peak_rss,
        "before": r.rss_before,
        "largest": r.largest_tensor_bytes,
    }


def step_compare(a: Path, b: Path) -> dict:
    """Every tensor of b equals a's, bitwise (read tensor by tensor)."""
    import torch

    from gspo_megatron.checkpoint.hf_io import HFCheckpoint

    left, right = HFCheckpoint(a), HFCheckpoint(b)
    assert sorted(left.names) == sorted(right.names)
    for name in left.names:
        x, y = left.read(name), right.read(name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name
    return {"tensors": len(left.names)}


STEPS = {
    "plain": step_plain,
    "hf_to_megatron": step_hf_to_megatron,
    "megatron_to_hf": step_megatron_to_hf,
    "compare": step_compare,
}


def run_step(name: str, *paths: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(
        [sys.executable, __file__, "--step", name, *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise SystemExit(f"step {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0, help="synthetic model size")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--step", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        name, *paths = args.step
        print(json.dumps(STEPS[name](*map(Path, paths))))
        return 0

    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        hf, plain, mc, back = root / "hf", root / "plain", root / "mc", root / "hf_back"
        for p in (hf, plain, mc, back):
            shutil.rmtree(p, ignore_errors=True)
        t0 = time.perf_counter()
        size = make_synthetic(hf, args.gb)
        print(
            f"synthetic Qwen3-MoE checkpoint: {size / 1e9:.2f} GB bf16 in "
            f"{len(list(hf.glob('*.safetensors')))} shards ({time.perf_counter() - t0:.0f} s)"
        )
        results = {
            "plain safetensors load+save": run_step("plain", hf, plain),
            "hf -> megatron (torch_dist)": run_step("hf_to_megatron", hf, mc),
            "megatron -> hf (safetensors)": run_step("megatron_to_hf", mc, back),
        }
        checked = run_step("compare", hf, back)["tensors"]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    base = results["plain safetensors load+save"]
    base_rate = base["bytes"] / base["seconds"]
    base_mem = base["peak"] - base["before"]
    mib = 2**20
    print(
        f"\n{'step':30s} {'GB/s':>7s} {'vs plain':>9s} {'peak RSS MiB':>13s} "
        f"{'(+ over start)':>15s} {'vs plain':>9s}"
    )
    for name, r in results.items():
        rate = r["bytes"] / r["seconds"]
        extra = r["peak"] - r["before"]
        print(
            f"{name:30s} {rate / 1e9:7.3f} {rate / base_rate:8.2f}x {r['peak'] / mib:13.0f} "
            f"{extra / mib:15.0f} {extra / max(base_mem, 1):8.3f}x"
        )
    largest = max(r.get("largest", 0) for r in results.values())
    print(
        f"\nmodel {size / 1e9:.2f} GB; largest single tensor {largest / mib:.0f} MiB; "
        f"round trip bitwise identical ({checked} tensors)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
