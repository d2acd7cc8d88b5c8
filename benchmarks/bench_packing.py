"""Packed (THD) against padded micro-batches, side by side in one run (CPU, one process).

    python benchmarks/bench_packing.py [--steps 4] [--samples 64] [--median 48] [--budget 8192]

The responses' lengths are long-tailed as RL responses are: lognormal around a median, scaled so
that the longest is 16x the median; prompts are 16-48 tokens. Both modes train the same model on
the same samples with the same micro-batch budget (engine.max_tokens_per_microbatch).

1. Tokens computed per useful token (padding included), padded vs packed (goal: packed padding
   <= 5% of computed tokens).
2. Wall time of one GSPO optimizer step, modes alternated, median ratio padded / packed
   (goal >= 1.5x).
3. Data-parallel balance of the packed plan: the most tokens a rank computes over the mean, for
   8 ranks and 512 sequences of the same distribution (goal <= 1.05), next to the padded plan's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np


def response_lengths(count: int, median: int, seed: int) -> list[int]:
    """Lognormal around `median`, its spread scaled so that the longest is 16x the median."""
    z = np.random.default_rng(seed).normal(size=count)
    z -= np.median(z)
    return [max(1, round(median * 16 ** (x / z.max()))) for x in z]


def prompt_lengths(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(16, 48) for _ in range(count)]


def dp_balance(median: int, budget: int) -> None:
    from gspo_megatron.megatron.batch import padded_length, plan_packed, plan_padded

    dp, count = 8, 512
    lengths = [
        p + r
        for p, r in zip(prompt_lengths(count, 1), response_lengths(count, median, 1), strict=True)
    ]
    packed = plan_packed(lengths, dp, budget)
    padded = plan_padded(lengths, dp, budget, 1)

    def imbalance(plans, computed) -> float:
        per_rank = [sum(computed(g) for g in plan) for plan in plans]
        return max(per_rank) / (sum(per_rank) / dp)

    packed_ratio = imbalance(packed, lambda g: sum(lengths[i] for i in g))
    padded_ratio = imbalance(
        padded, lambda g: len(g) * padded_length(max(lengths[i] for i in g), 1)
    )
    print(f"data-parallel balance ({dp} ranks, {count} sequences, budget {budget} tokens):")
    for mode, ratio, plans in (("packed", packed_ratio, packed), ("padded", padded_ratio, padded)):
        print(f"  {mode}: max/mean tokens per rank {ratio:.4f}, {len(plans[0])} micro-batches each")
    print("  goal: packed <= 1.05")


def step_times(steps: int, count: int, median: int, budget: int) -> None:
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.loss import LossSettings
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.sample import TrainSample
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    layout = ParallelLayout()
    parallel.initialize(layout, seed=0)
    vocab = 8192
    max_length = 48 + 16 * median
    model = load_preset(
        "tiny_moe",
        hidden_size=256,
        num_hidden_layers=4,
        vocab_size=vocab,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        moe_intermediate_size=256,
        num_experts=8,
        make_vocab_size_divisible_by=128,
        max_position_embeddings=max_length,
    )
    engine = TrainingEngine(
        model,
        layout,
        EngineSettings(max_sequence_length=max_length, max_tokens_per_microbatch=budget),
        OptimizerSettings(lr=1e-6),
    )
    rng = random.Random(0)
    samples = [
        TrainSample(
            [rng.randrange(vocab) for _ in range(p)],
            [rng.randrange(vocab) for _ in range(r)],
            advantage=rng.gauss(0, 1),
        )
        for p, r in zip(prompt_lengths(count, 0), response_lengths(count, median, 0), strict=True)
    ]
    for s, lp in zip(samples, engine.forward(samples).logprobs, strict=True):
        s.old_logprobs = (lp + 0.01).tolist()
    seconds: dict[str, list[float]] = {"padded": [], "packed": []}
    stats: dict[str, dict[str, float]] = {}
    for i in range(steps + 1):
        for mode in seconds:
            engine.settings.pack_sequences = mode == "packed"
            start = time.perf_counter()
            metrics = engine.train_step(samples, LossSettings("gspo"))
            if i >= 1:  # the first round warms up
                seconds[mode].append(time.perf_counter() - start)
            stats[mode] = {
                "padding": metrics["padding_fraction"],
                "microbatches": metrics["num_microbatches"],
            }
    useful = sum(s.length for s in samples)
    print(
        f"step time ({steps} rounds alternated; {count} sequences, {useful} tokens, lengths "
        f"median {median}, longest {max(s.length for s in samples)}; budget {budget} tokens per "
        "micro-batch; CPU, one process):"
    )
    for mode, times in seconds.items():
        padding = stats[mode]["padding"]
        print(
            f"  {mode}: {statistics.median(times):7.3f} s, {1 / (1 - padding):.3f} tokens computed "
            f"per useful token (padding {padding:.1%}), "
            f"{stats[mode]['microbatches']:.0f} micro-batches"
        )
    ratio = statistics.median(
        a / b for a, b in zip(seconds["padded"], seconds["packed"], strict=True)
    )
    print(f"  padded / packed step time: {ratio:.2f}x")
    print("  goals: packed padding <= 5%, padded / packed >= 1.5x")
    parallel.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--median", type=int, default=48)
    parser.add_argument("--budget", type=int, default=8192)
    args = parser.parse_args()
    dp_balance(args.median, args.budget)
    step_times(args.steps, args.samples, args.median, args.budget)


if __name__ == "__main__":
    main()
