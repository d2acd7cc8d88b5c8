"""Generation throughput: the embedded megatron engine vs transformers `generate`, side by side.

    python benchmarks/bench_rollout.py                       # tiny_moe, 16 prompts x 8, 32 tokens
    python benchmarks/bench_rollout.py --prompts 64 --n 8 --new-tokens 64 --repeats 7
    python benchmarks/bench_rollout.py --backend megatron    # megatron's GPTModel decode path

Both engines run the same tiny Qwen3-MoE architecture (transformers' Qwen3MoeForCausalLM built
from the equivalent config; the weights differ, which does not matter for speed) on the same
batch: the same prompts of varied length (left-padded with an attention mask for transformers),
`n` sampled responses each, temperature 1, exactly `--new-tokens` tokens per response (no stop
token, so both produce the same number of tokens). Each round times both engines once, in
alternating order, so drift of the machine hits both alike; the table reports the median over
rounds, as wall-clock and as CPU time of the process (robust when other jobs share the cores;
one torch thread by default so that the two agree on an idle machine). Goal: embedded >= 1.5x
transformers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch


def build_embedded(preset: str, batch_tokens: int, backend: str = "auto"):
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    config = load_preset(preset)
    layout = ParallelLayout()
    parallel.initialize(layout, seed=1234)
    trainer = TrainingEngine(
        config,
        layout,
        EngineSettings(max_sequence_length=config.max_position_embeddings),
        OptimizerSettings(lr=1e-4),
    )
    return config, EmbeddedEngine(trainer, max_batch_tokens=batch_tokens, backend=backend)


def build_hf(config):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = config.to_hf()
    hf.pop("architectures")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).eval()


def time_embedded(engine, prompts, n: int, new_tokens: int, seed: int):
    """(wall seconds, CPU seconds, generated tokens)."""
    from gspo_megatron.rollout.base import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed)
    wall, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(prompts, n, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, sum(len(s.response_ids) for group in out for s in group)


def time_hf(model, prompts, n: int, new_tokens: int, seed: int):
    """(wall seconds, CPU seconds, generated tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as transformers expects
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    torch.manual_seed(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, (out.shape[1] - width) * out.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny_moe")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--batch-tokens", type=int, default=65536, help="embedded max_batch_tokens")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "megatron"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    config, embedded = build_embedded(args.preset, args.batch_tokens, args.backend)
    hf = build_hf(config)
    rng = random.Random(0)
    prompts = [
        [
            rng.randrange(config.vocab_size)
            for _ in range(rng.randint(args.min_prompt, args.max_prompt))
        ]
        for _ in range(args.prompts)
    ]
    runners = {
        "embedded": lambda seed: time_embedded(embedded, prompts, args.n, args.new_tokens, seed),
        "transformers": lambda seed: time_hf(hf, prompts, args.n, args.new_tokens, seed),
    }
    for runner in runners.values():  # warm-up (allocator, lazy init)
        runner(0)
    walls: dict[str, list[float]] = {name: [] for name in runners}
    cpus: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, int] = {}
    for round_ in range(args.repeats):
        order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
        for name in order:
            wall, cpu, count = runners[name](round_ + 1)
            walls[name].append(wall)
            cpus[name].append(cpu)
            tokens[name] = count
    print(
        f"{args.preset}: {args.prompts} prompts x {args.n} samples, prompt length "
        f"{args.min_prompt}-{args.max_prompt}, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, embedded decoder {embedded.decoder.name}, "
        f"median of {args.repeats} rounds"
    )
    print(
        f"{'engine':<14}{'tokens':>8}{'wall s':>9}{'tokens/s':>10}{'CPU s':>9}{'tokens/CPU s':>14}"
    )
    wall_rate, cpu_rate = {}, {}
    for name in runners:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        wall_rate[name], cpu_rate[name] = tokens[name] / wall, tokens[name] / cpu
        print(
            f"{name:<14}{tokens[name]:>8}{wall:>9.3f}{wall_rate[name]:>10.0f}{cpu:>9.3f}"
            f"{cpu_rate[name]:>14.0f}"
        )
    print(
        f"ratio embedded / transformers: {wall_rate['embedded'] / wall_rate['transformers']:.2f}x "
        f"wall-clock, {cpu_rate['embedded'] / cpu_rate['transformers']:.2f}x CPU time"
    )


if __name__ == "__main__":
    main()
