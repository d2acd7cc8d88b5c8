"""Weight-sync throughput vs a plain memcpy of the same bytes, side by side (CPU, one process).

    python benchmarks/bench_weight_sync.py [--hidden 512] [--layers 4] [--bucket-mb 64]

1. export: the trainer's megatron weights gathered into Hugging Face-named buckets
   (`MegatronWeightSource.buckets`, what every weight sync starts from: QKV split, gate/up split,
   per-expert tensors, vocabulary padding dropped) vs copying the same number of bytes between
   preallocated buffers in the same bucket sizes.
2. tensor mode end to end: `SGLangEngine.update_weights` in colocated `tensor` mode (buckets
   serialised as shared-memory handles, /begin_weight_update ... /end_weight_update) against
   the test server of tests/rollout, which receives and checks every tensor (a real SGLang
   server would load them into its model instead).
Goal: weight sync >= 50% of memcpy throughput. The embedded engine needs no sync at all (it
shares the trainer's parameters).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def wide_moe(hidden: int, layers: int):
    """tiny_moe widened to `hidden` with `layers` layers, 8 experts and a 32k vocabulary."""
    from gspo_megatron.spec.model_config import load_preset

    return load_preset(
        "tiny_moe",
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=32000,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        moe_intermediate_size=hidden,
        num_experts=8,
        make_vocab_size_divisible_by=128,
    )


def build_source(hidden: int, layers: int):
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.megatron.weight_export import MegatronWeightSource
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    model = wide_moe(hidden, layers)
    layout = ParallelLayout()
    parallel.initialize(layout, seed=0)
    engine = TrainingEngine(
        model,
        layout,
        EngineSettings(max_sequence_length=64),
        OptimizerSettings(distributed_optimizer=False),
    )
    return engine, MegatronWeightSource.from_engine(engine)


def time_export(source, bucket_bytes: int) -> tuple[float, int, list[int]]:
    start = time.perf_counter()
    total, sizes = 0, []
    for bucket in source.buckets(bucket_bytes):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        total += size
        sizes.append(size)
    return time.perf_counter() - start, total, sizes


def time_memcpy(sizes: list[int]) -> float:
    sources = [torch.empty(s, dtype=torch.uint8).fill_(1) for s in sizes]
    targets = [torch.empty(s, dtype=torch.uint8) for s in sizes]
    start = time.perf_counter()
    for src, dst in zip(sources, targets, strict=True):
        dst.copy_(src)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bucket = args.bucket_mb * 2**20
    engine, source = build_source(args.hidden, args.layers)
    export_s, memcpy_s, total = [], [], 0
    for _ in range(args.repeats):
        seconds, total, sizes = time_export(source, bucket)
        export_s.append(seconds)
        memcpy_s.append(time_memcpy(sizes))
    gb = total / 1e9
    e, m = statistics.median(export_s), statistics.median(memcpy_s)
    print(
        f"{gb:.3f} GB of weights in {args.bucket_mb} MiB buckets, {args.repeats} rounds, "
        "one thread, medians:"
    )
    print(f"  memcpy of the same bytes       {gb / m:7.2f} GB/s")
    print(f"  export to HF-named buckets     {gb / e:7.2f} GB/s   {m / e:6.1%} of memcpy")

    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    from sglang_test_server import start_fake_server

    from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
    from gspo_megatron.rollout.sglang.engine import SGLangEngine

    server = start_fake_server(routed_experts=False)
    try:
        client = SGLangEngine(
            SGLangEngineConfig(urls=[server.url], weight_sync="tensor", bucket_bytes=bucket)
        )
        sync_s = []
        for version in range(1, args.repeats + 1):
            start = time.perf_counter()
            client.update_weights(source, version=version)
            sync_s.append(time.perf_counter() - start)
        client.close()
    finally:
        server.stop()
    s = statistics.median(sync_s)
    print(f"  tensor-mode sync to the test server {gb / s:7.2f} GB/s   {m / s:6.1%} of memcpy")
    print("  goal: >= 50% of memcpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
