"""Context kept between turns (rollout.prefix_cache_tokens): prefill tokens and time of the same
multi-turn episodes with and without the embedded engine's prefix cache, side by side in one run
(CPU, one process, the torch decoder over a small Qwen3-MoE built by megatron).

    python benchmarks/bench_prefix_cache.py [--episodes 8] [--turns 1-6] [--repeats 3]
        [--prompt-tokens 256-512] [--observation-tokens 16-64] [--max-new-tokens 16]

Each episode has a prompt of --prompt-tokens tokens and --turns model turns (drawn per episode)
of up to --max-new-tokens tokens; between two turns an observation of --observation-tokens random
token ids is appended
(token-in / token-out, as rollout/episodes.py does), and every turn generates for all live
episodes in one call, turn-synchronously. Both engines see the same calls on the same weights;
the samples are checked equal (tokens, log-probs within 1e-5). Printed: prompt tokens
prefilled (without the cache: every prompt token of every turn), tokens reused, and the
generate time (median of --repeats, the two variants alternated), with the ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def build_trainer(args):
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    layout = ParallelLayout()
    parallel.initialize(layout, seed=0)
    model = load_preset(
        "tiny_moe",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        vocab_size=4096,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        moe_intermediate_size=args.hidden,
        num_experts=8,
        max_position_embeddings=2048,
    )
    return TrainingEngine(
        model, layout, EngineSettings(max_sequence_length=2048), OptimizerSettings(lr=1e-4)
    )


def run_episodes(engine, args, seed: int):
    """Every turn's samples (per turn, per live episode) and the prompt tokens sent."""
    from gspo_megatron.rollout.base import SamplingParams

    rng = random.Random(seed)
    contexts = [
        [rng.randrange(4096) for _ in range(rng.randint(*args.prompt_tokens))]
        for _ in range(args.episodes)
    ]
    turns_left = [rng.randint(*args.turns) for _ in range(args.episodes)]
    live = list(range(args.episodes))
    out, sent = [], 0
    turn = 0
    while live:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=seed * 1000 + turn)
        sent += sum(len(contexts[e]) for e in live)
        groups = engine.generate([contexts[e] for e in live], 1, params)
        out.append([g[0] for g in groups])
        for e, (sample,) in zip(live, groups, strict=True):
            turns_left[e] -= 1
            contexts[e] = contexts[e] + sample.response_ids
            if turns_left[e]:
                observation = rng.randint(*args.observation_tokens)
                contexts[e] += [rng.randrange(4096) for _ in range(observation)]
        live = [e for e in live if turns_left[e]]
        turn += 1
    return out, sent


def span(text: str) -> tuple[int, int]:
    """lo-hi (inclusive)."""
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=span, default="1-6", help="model turns per episode")
    parser.add_argument("--prompt-tokens", type=span, default="256-512")
    parser.add_argument("--observation-tokens", type=span, default="16-64")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=65536, help="rollout.prefix_cache_tokens")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    trainer = build_trainer(args)  # applies the CPU shims before megatron-core is imported
    from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine

    engines = {
        "without": EmbeddedEngine(trainer, backend="torch"),
        "with": EmbeddedEngine(trainer, backend="torch", prefix_cache_tokens=args.budget),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    samples, sent, metrics = {}, 0, {}
    for repeat in range(args.repeats):
        for name in engines if repeat % 2 == 0 else reversed(engines):
            engine = engines[name]
            start = time.perf_counter()
            samples[name], sent = run_episodes(engine, args, seed=1)
            times[name].append(time.perf_counter() - start)
            if name == "with":
                metrics = engine.metrics()
                engine.release_kept_context()
    worst = 0.0
    for a_turn, b_turn in zip(samples["with"], samples["without"], strict=True):
        for a, b in zip(a_turn, b_turn, strict=True):
            if a.response_ids != b.response_ids:
                raise SystemExit("the cache changed a sampled token")
            worst = max([worst] + [abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)])
    if worst > 1e-5:
        raise SystemExit(f"the cache changed a log-prob by {worst:.2e}")
    prefilled = metrics["rollout/prefill_tokens"]
    reused = metrics["rollout/prefix_cache_reused_tokens"]
    turns = sum(len(t) for t in samples["with"])
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{args.episodes} episodes, {turns} model turns ({'-'.join(map(str, args.turns))} per "
        f"episode), {sent} prompt tokens sent; hidden {args.hidden}, {args.layers} layers, "
        "1 thread"
    )
    print(f"{'':>16} {'prefilled':>10} {'reused':>8} {'generate s':>11}")
    print(f"{'without cache':>16} {sent:>10} {0:>8} {median['without']:>11.3f}")
    print(f"{'with cache':>16} {prefilled:>10.0f} {reused:>8.0f} {median['with']:>11.3f}")
    hits, lookups = (metrics[f"rollout/prefix_cache_{k}"] for k in ("hits", "lookups"))
    print(
        f"prefill tokens with/without: {prefilled / sent:.3f}; time with/without: "
        f"{median['with'] / median['without']:.3f}; cache hits {hits:.0f} of {lookups:.0f} "
        f"prompts; evictions {metrics['rollout/prefix_cache_evictions']:.0f}; "
        f"max |log-prob diff| {worst:.1e}"
    )
    trainer.close()


if __name__ == "__main__":
    main()
