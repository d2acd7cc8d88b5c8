"""Offloading the training state during rollouts, against a plain copy of the same bytes, side by
side in one run (CPU, one process).

    python benchmarks/bench_offload.py [--rounds 7]

The model of bench_engine, trained one Adam step (distributed optimizer) so that its optimizer
state exists. Each round offloads everything the trainer would with
trainer.offload_during_rollout=all and SGLang (weights, gradient buffers, optimizer state) and
reloads it, alternated with a plain copy of the same number of bytes out of one contiguous
tensor and back (pinned host memory on a GPU). Throughput = bytes copied / seconds; the goal is
offload + reload at >= 50% of the plain copy's.

On CPU the "device" storage freed by an offload is host memory, so it is measured twice, each in
a fresh process: with glibc's defaults, which hand large freed blocks back to the kernel (every
page of the reloaded state then faults and is zeroed again), and with freed memory kept in the
process, as a GPU's caching allocator keeps it (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

# glibc: no mmap for blocks below 32 MiB (its maximum threshold), no trimming of the heap.
KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(2**32),
    "MALLOC_TRIM_THRESHOLD_": str(2**34),
    "MALLOC_TOP_PAD_": str(2**30),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.rounds)
        return
    for title, extra in (
        ("glibc defaults (freed blocks go back to the kernel)", {}),
        ("freed memory kept in the process (as a GPU caching allocator)", KEEP_FREED_MEMORY),
    ):
        print(f"-- {title}", flush=True)
        command = [
            sys.executable,
            "-W",
            "ignore",
            __file__,
            "--measure",
            "--rounds",
            str(args.rounds),
        ]
        subprocess.run(command, env=dict(os.environ, **extra), check=True)


def measure(rounds: int) -> None:
    import torch

    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.device import accelerator, pinned_for_accelerator
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.offload import StateOffloader
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.loss import LossSettings
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.sample import TrainSample
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    layout = ParallelLayout()
    parallel.initialize(layout, seed=0)
    model = load_preset(
        "tiny_moe",
        hidden_size=256,
        num_hidden_layers=4,
        vocab_size=8192,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        moe_intermediate_size=256,
        num_experts=8,
        make_vocab_size_divisible_by=128,
        max_position_embeddings=512,
    )
    engine = TrainingEngine(
        model, layout, EngineSettings(max_sequence_length=512), OptimizerSettings(lr=1e-5)
    )
    rng = random.Random(0)
    samples = [
        TrainSample(
            [rng.randrange(8192) for _ in range(32)],
            [rng.randrange(8192) for _ in range(64)],
            advantage=rng.gauss(0, 1),
        )
        for _ in range(8)
    ]
    for s, lp in zip(samples, engine.forward(samples).logprobs, strict=True):
        s.old_logprobs = lp.tolist()
    engine.train_step(samples, LossSettings("gspo"))

    offloader = StateOffloader(engine, "all", keep_weights=False)
    moved = offloader.offload()
    offloader.reload()
    copied = int(moved["offload_bytes"])
    source = torch.randn(copied // 4, device=accelerator())
    host = pinned_for_accelerator(torch.empty_like(source, device="cpu"))

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    seconds: dict[str, list[float]] = {"offload + reload": [], "plain copy out and back": []}
    for _ in range(rounds):
        start = time.perf_counter()
        offloader.offload()
        offloader.reload()
        sync()
        seconds["offload + reload"].append(time.perf_counter() - start)
        start = time.perf_counter()
        host.copy_(source, non_blocking=host.is_pinned())
        sync()
        source.copy_(host, non_blocking=host.is_pinned())
        sync()
        seconds["plain copy out and back"].append(time.perf_counter() - start)
    print(
        f"offload of the training state ({copied / 2**20:.1f} MiB copied each way: weights and "
        f"Adam state; gradient buffers freed and re-zeroed; {rounds} rounds alternated, "
        f"{accelerator()}):"
    )
    for name, times in seconds.items():
        rate = 2 * copied / statistics.median(times) / 2**30
        print(f"  {name:<26} {statistics.median(times) * 1e3:8.1f} ms   {rate:6.2f} GiB/s")
    ratio = statistics.median(
        plain / ours
        for ours, plain in zip(
            seconds["offload + reload"], seconds["plain copy out and back"], strict=True
        )
    )
    print(f"  offload + reload throughput: {ratio:.0%} of the plain copy's (goal >= 50%)")
    parallel.destroy()


if __name__ == "__main__":
    main()
