"""Bytes and time per weight sync with LoRA vs full-parameter training, side by side in one run.

    python benchmarks/bench_lora_sync.py [--rank 8] [--repeats 5] [--hidden 512 --layers 4]

1. Measured on the tiny MoE (conf/model/tiny_moe.yaml; with --hidden, widened as
   bench_weight_sync.py widens it: 8 experts, a 32,000-token vocabulary), one process, CPU,
   float32, per sync, the median of `--repeats`:
   - full: a full-parameter policy's weights gathered into HF buckets
     (`MegatronWeightSource.buckets`, what every full sync starts from);
   - LoRA merged: the same model with rank-r adapters on every linear layer, the merged weights
     base + alpha/r * B @ A (`LoRAWeightSource.buckets`; SGLang, rollout.sglang.lora_sync=merged);
   - LoRA adapters: the adapters alone under PEFT names (what the generator process receives at
     every update after the first);
   - and the generator process's `update_weights` end to end (into its shared-memory staging
     copy) for the full policy and the LoRA one.
2. Computed for the paper-scale preset's shape (conf/model/qwen3_30b_a3b.yaml) in bfloat16:
   the whole model against its adapters at r=16 and r=32, all-linear (experts included) and
   attention only. Bytes are those the mappings name (a fused layer's A counted once per HF
   module, as PEFT stores it).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

from bench_weight_sync import wide_moe  # benchmarks/ is the script's directory


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds of `fn()` over `repeats` after one untimed call, and the bytes it
    returned."""
    times, size = [], fn()
    for _ in range(repeats):
        start = time.perf_counter()
        size = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), size


def bucket_bytes(buckets) -> int:
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


def tiny_moe(hidden: int | None, layers: int):
    from gspo_megatron.spec.model_config import load_preset

    return load_preset("tiny_moe") if hidden is None else wide_moe(hidden, layers)


def measured(model, rank: int, repeats: int) -> list[tuple[str, float, int]]:
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.config import RunConfig
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.lora_sync import LoRAWeightSource
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.megatron.weight_export import MegatronWeightSource
    from gspo_megatron.rollout.embedded.backend import build_generator_process
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.lora import LoRASettings
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    layout = ParallelLayout()
    parallel.initialize(layout, seed=0)
    engines = {
        name: TrainingEngine(
            model, layout, EngineSettings(max_sequence_length=64), OptimizerSettings(), lora=lora
        )
        for name, lora in (("full", None), ("lora", LoRASettings(rank=rank)))
    }
    full = MegatronWeightSource.from_engine(engines["full"])
    lora = LoRAWeightSource.from_engine(engines["lora"])
    size = 64 << 20
    rows = [
        ("full: HF buckets", *timed(lambda: bucket_bytes(full.buckets(size)), repeats)),
        (f"LoRA r={rank}: merged", *timed(lambda: bucket_bytes(lora.buckets(size)), repeats)),
        (f"LoRA r={rank}: adapters", *timed(lambda: bucket_bytes(lora.adapters.buckets(size)),
                                            repeats)),
    ]  # fmt: skip
    cfg = RunConfig()
    cfg.rollout.mode = "one_step_off"
    cfg.engine.max_sequence_length = 64
    for name, label in (("full", "full"), ("lora", f"LoRA r={rank}")):
        engine, source = build_generator_process(cfg, engines[name], False)
        try:
            engine.update_weights(source, 0)  # a LoRA policy's base goes with this one
            versions = iter(range(1, repeats + 2))
            update = functools.partial(lambda e, s, v: e.update_weights(s, next(v)), engine,
                                       source, versions)  # fmt: skip
            seconds, _ = timed(update, repeats)
        finally:
            engine.close()
        sent = source.adapters if name == "lora" else source
        rows.append((f"{label}: generator process update", seconds,
                     bucket_bytes(sent.buckets(size))))  # fmt: skip
    for engine in engines.values():
        engine.close()
    parallel.destroy()
    return rows


def computed() -> list[tuple[str, int, int]]:
    from gspo_megatron.checkpoint.lora_mapping import adapter_mapping
    from gspo_megatron.checkpoint.mapping import get_mapping
    from gspo_megatron.spec.lora import ATTENTION_TARGETS, LoRASettings
    from gspo_megatron.spec.model_config import load_preset

    model = load_preset("qwen3_30b_a3b")
    bf16 = 2

    def nbytes(mapping) -> int:
        vocab = model.vocab_size
        total = 0
        for entry in mapping.entries:
            for shape in entry.hf_shapes:
                if entry.kind == "vocab":
                    shape = (vocab, *shape[1:])
                total += math.prod(shape) * bf16
        return total

    whole = nbytes(get_mapping(model))
    rows = []
    for rank in (16, 32):
        for label, targets in (("all-linear", ["all-linear"]),
                               ("attention", list(ATTENTION_TARGETS))):  # fmt: skip
            lora = LoRASettings(rank=rank, targets=targets)
            rows.append((f"r={rank} {label}", whole, nbytes(adapter_mapping(model, lora))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=None, help="widen the tiny MoE")
    parser.add_argument("--layers", type=int, default=4, help="with --hidden")
    args = parser.parse_args()
    rows = measured(tiny_moe(args.hidden, args.layers), args.rank, args.repeats)
    shape = "" if args.hidden is None else f" hidden {args.hidden}, {args.layers} layers"
    print(f"tiny_moe{shape} (float32, one process), per weight sync, median of {args.repeats}")
    print(f"  {'':40s} {'bytes':>12s} {'vs full':>8s} {'ms':>8s} {'vs full':>8s}")
    base = {"export": rows[0], "process": rows[3]}
    for name, seconds, size in rows:
        ref = base["process" if "generator" in name else "export"]
        print(f"  {name:40s} {size:12,d} {size / ref[2]:8.3f} {seconds * 1e3:8.2f} "
              f"{seconds / ref[1]:8.3f}")  # fmt: skip
    print("qwen3_30b_a3b (bfloat16, computed): the whole model vs its adapters, per sync")
    for name, whole, adapters in computed():
        print(f"  {name:22s} model {whole / 2**30:7.2f} GiB  adapters {adapters / 2**20:8.1f} MiB "
              f"= {adapters / whole:.4f} of the model")  # fmt: skip


if __name__ == "__main__":
    main()
