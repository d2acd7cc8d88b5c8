"""Packed (THD) against padded micro-batches, side by side in one run (CPU, one process).

    python benchmarks/bench_packing.py [--scenario both] [--steps 4] [--short-steps 20]
        [--samples 64] [--median 48] [--budget 8192]

Two workloads (--scenario tail | short | both; both by default):

- tail: responses long-tailed as RL responses are: lognormal around --median, scaled so that
  the longest is 16x the median; prompts 16-48 tokens; --samples sequences on a 4-layer MoE
  (hidden 256, 8 experts). Mode for mode: one GSPO optimizer step over all of them with the
  --budget tokens per micro-batch.
- short: what bench_vs_trl.py and the default run train: 128 sequences of 8-12 prompt and 1-5
  response tokens, nearly uniform, on the default tiny_moe model with the default engine
  settings; one RL step's engine work: the old log-probs of the 128, then 4 optimizer steps
  of 32. Here padding saves little, so this is where packing's own costs (planning, cu_seqlens,
  the attention plan, RoPE and route re-ordering) show.

For each, printed:
1. Tokens computed per useful token (padding included), padded vs packed (goal: packed padding
   <= 5% of computed tokens).
2. Wall and CPU time (the process's) of the measured work, modes alternated, median ratios
   padded / packed (goals: >= 1.5x on tail; >= 1.0x, within noise, on short).
And once, for the tail distribution: 3. Data-parallel balance of the packed plan: the most
tokens a rank computes over the mean, for 8 ranks and 512 sequences of the same distribution
(goal <= 1.05), next to the padded plan's.
"""

from __future__ import annotations

import argparse
import os
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


def tail_workload(count: int, median: int, budget: int):
    """(model, engine settings, samples, the work to time) of the long-tailed scenario."""
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.training import EngineSettings

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
    settings = EngineSettings(max_sequence_length=max_length, max_tokens_per_microbatch=budget)
    lengths = zip(prompt_lengths(count, 0), response_lengths(count, median, 0), strict=True)

    def work(engine, samples, loss):
        return engine.train_step(samples, loss)

    return model, settings, _samples(lengths, vocab), work, "one GSPO optimizer step"


def short_workload():
    """The same for bench_vs_trl's (and the default run's) short, nearly uniform sequences."""
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.training import EngineSettings

    model = load_preset("tiny_moe")
    rng = random.Random(0)
    lengths = [(rng.randint(8, 12), rng.randint(1, 5)) for _ in range(128)]

    def work(engine, samples, loss):
        engine.forward(samples)
        for i in range(4):
            metrics = engine.train_step(samples[32 * i : 32 * (i + 1)], loss)
        return metrics

    return (
        model,
        EngineSettings(),
        _samples(lengths, model.vocab_size),
        work,
        "old log-probs of 128 sequences + 4 optimizer steps of 32",
    )


def _samples(lengths, vocab: int):
    from gspo_megatron.spec.sample import TrainSample

    rng = random.Random(0)
    return [
        TrainSample(
            [rng.randrange(vocab) for _ in range(p)],
            [rng.randrange(vocab) for _ in range(r)],
            advantage=rng.gauss(0, 1),
        )
        for p, r in lengths
    ]


def step_times(name: str, steps: int, workload) -> None:
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.loss import LossSettings
    from gspo_megatron.spec.training import OptimizerSettings

    layout = ParallelLayout()
    parallel.initialize(layout, seed=0)
    model, settings, samples, work, what = workload
    engine = TrainingEngine(model, layout, settings, OptimizerSettings(lr=1e-6))
    for s, lp in zip(samples, engine.forward(samples).logprobs, strict=True):
        s.old_logprobs = (lp + 0.01).tolist()
    seconds: dict[str, list[float]] = {"padded": [], "packed": []}
    cpu: dict[str, list[float]] = {"padded": [], "packed": []}
    padding: dict[str, float] = {}
    for i in range(steps + 1):
        for mode in seconds:
            engine.settings.pack_sequences = mode == "packed"
            start, start_cpu = time.perf_counter(), time.process_time()
            work(engine, samples, LossSettings("gspo"))
            if i >= 1:  # the first round warms up
                seconds[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - start_cpu)
            padding[mode] = engine.batch_stats["padding_fraction"]
    useful = sum(s.length for s in samples)
    lengths = sorted(s.length for s in samples)
    print(
        f"{name}: {what} ({steps} rounds alternated; {len(samples)} sequences, {useful} tokens, "
        f"lengths median {lengths[len(lengths) // 2]}, longest {lengths[-1]}; budget "
        f"{settings.max_tokens_per_microbatch} tokens per micro-batch; CPU, one process; load "
        f"average {os.getloadavg()[0]:.1f}):"
    )
    for mode, times in seconds.items():
        print(
            f"  {mode}: {statistics.median(times):7.3f} s wall, {statistics.median(cpu[mode]):7.3f}"
            f" s CPU, {1 / (1 - padding[mode]):.3f} tokens computed per useful token (padding "
            f"{padding[mode]:.1%})"
        )

    def ratio(times: dict[str, list[float]]) -> float:
        return statistics.median(
            a / b for a, b in zip(times["padded"], times["packed"], strict=True)
        )

    # CPU time holds steadier than wall time on a machine that other jobs share.
    print(f"  padded / packed: {ratio(seconds):.2f}x wall, {ratio(cpu):.2f}x CPU time")
    print(f"  goals: packed padding <= 5%, padded / packed {GOALS[name]}")
    parallel.destroy()


GOALS = {"tail": ">= 1.5x", "short": ">= 1.0x (within noise)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", choices=["tail", "short", "both"], default="both")
    parser.add_argument("--steps", type=int, default=4, help="rounds of the tail scenario")
    parser.add_argument(
        "--short-steps", type=int, default=20, help="rounds of the short one (~0.2 s each)"
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--median", type=int, default=48)
    parser.add_argument("--budget", type=int, default=8192)
    args = parser.parse_args()
    if args.scenario in ("tail", "both"):
        dp_balance(args.median, args.budget)
        step_times("tail", args.steps, tail_workload(args.samples, args.median, args.budget))
    if args.scenario in ("short", "both"):
        step_times("short", args.short_steps, short_workload())


if __name__ == "__main__":
    main()
