"""Training-engine overheads, measured side by side in one run (CPU, one process).

    python benchmarks/bench_engine.py [--steps 12] [--tokens 4096] [--vocab 151936]

1. Step time: one GSPO optimizer step as the trainer takes it (actor/entropy is measured by the
   old-policy forward, not in the step) vs one plain cross-entropy step (megatron's
   vocab_parallel_cross_entropy) on the same tokens, same model, same schedule and optimizer;
   alternated, median ratio (goal <= 1.05x). Beside them: the step measuring the entropy
   itself (what it does without an old-policy forward, algorithm.old_logprobs=rollout), and the
   old-policy forward without and with the entropy (where the metric's pass now is).
2. Memory of per-token log-probs + entropy at a Qwen3 vocabulary: peak RSS growth above the
   logits, each variant in fresh subprocesses (median of 3, since the C allocator keeps some
   freed memory), for our chunked computation vs a plain float32 log_softmax, relative to the
   size of the (bf16) logits tensor (goal: our extra <= 10% of the logits; the backward's
   gradient w.r.t. the logits, the same size as the logits and needed by any method, is
   reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_times(steps: int) -> None:
    import torch

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
        max_position_embeddings=1024,
    )
    engine = TrainingEngine(
        model,
        layout,
        EngineSettings(max_sequence_length=512, max_tokens_per_microbatch=4096),
        OptimizerSettings(lr=1e-5),
    )
    rng = random.Random(0)
    samples = []
    for _ in range(32):
        prompt = [rng.randrange(8192) for _ in range(rng.randint(32, 96))]
        response = [rng.randrange(8192) for _ in range(rng.randint(64, 384))]
        samples.append(TrainSample(prompt, response, advantage=rng.gauss(0, 1)))
    for s, lp in zip(samples, engine.forward(samples).logprobs, strict=True):
        s.old_logprobs = (lp + 0.01).tolist()

    def gspo_step() -> None:
        # the trainer's optimizer step: actor/entropy comes from the old-policy forward
        engine.train_step(samples, LossSettings("gspo"), entropy_metric=False)

    def gspo_step_with_entropy() -> None:
        # without an old-policy forward (algorithm.old_logprobs=rollout) the step measures it
        engine.train_step(samples, LossSettings("gspo"))

    def old_forward() -> None:
        engine.forward(samples)

    def old_forward_with_entropy() -> None:
        engine.forward(samples, with_entropy=True)

    # megatron is imported only after gspo_megatron.megatron installed its CPU shims.
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def ce_step() -> None:
        # Same schedule, model and optimizer; megatron's cross-entropy as the loss.
        def loss_fn(mb, logits):
            ce = mb.rows(vocab_parallel_cross_entropy(logits.float(), mb.labels))
            loss = (ce * mb.loss_mask).sum() / mb.loss_mask.sum()
            return loss, torch.tensor(1), {}

        for m in engine.model:
            m.zero_grad_buffer()
        engine.optimizer.zero_grad()
        engine._run_schedule(samples, loss_fn, forward_only=False, token_advantages=False)
        engine.optimizer.step()

    variants = {
        "gspo step": gspo_step,
        "gspo step, entropy in the step": gspo_step_with_entropy,
        "old-policy forward": old_forward,
        "old-policy forward + entropy": old_forward_with_entropy,
        "cross-entropy step": ce_step,
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(steps + 2):
        for name, step in variants.items():
            start = time.perf_counter()
            step()
            if i >= 2:  # warm-up
                seconds[name].append(time.perf_counter() - start)
    tokens = sum(s.length for s in samples)
    ce = seconds["cross-entropy step"]
    print(f"step time ({steps} rounds, variants alternated, {tokens} tokens, vocab 8192, CPU):")
    for name, times in seconds.items():
        ratio = statistics.median(t / c for t, c in zip(times, ce, strict=True))
        print(f"  {name:<32} {statistics.median(times):7.3f} s   {ratio:6.3f}x cross-entropy")
    print("  goal: gspo <= 1.05x cross-entropy")
    parallel.destroy()


def memory_probe(variant: str, tokens: int, vocab: int) -> None:
    """Runs in a fresh process: peak RSS growth of one log-prob + entropy computation."""
    import torch

    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron.logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    logits = (torch.randn(tokens, vocab, dtype=torch.bfloat16)).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    # Warm up on a few tokens first: thread pools and lazy kernel state are not our extra.
    few = logits[:4].detach().clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(few, targets[:4], vocab_size=vocab)
    (lp.sum() + ent.sum()).backward()
    base = _rss_peak()
    if variant == "chunked":
        lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=vocab)
    else:
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = logp.gather(1, targets[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1)
    forward_peak = _rss_peak()
    (lp.sum() + ent.sum()).backward()
    backward_peak = _rss_peak()
    result = {
        "forward": forward_peak - base,
        "backward": backward_peak - base,
        "logits": logits.numel() * logits.element_size(),
    }
    print(json.dumps(result))


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory(tokens: int, vocab: int) -> None:
    results = {}
    for variant in ("chunked", "plain"):
        # A fixed mmap threshold makes large buffers return to the system when freed, so that
        # peak RSS follows what is live rather than the C allocator's retained heap.
        env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="1048576")
        runs = [_probe_once(variant, tokens, vocab, env) for _ in range(3)]
        results[variant] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    logits = results["chunked"]["logits"]
    _print_memory(results, tokens, vocab, logits)


def _probe_once(variant: str, tokens: int, vocab: int, env: dict) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--probe",
            variant,
            "--tokens",
            str(tokens),
            "--vocab",
            str(vocab),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _print_memory(results: dict, tokens: int, vocab: int, logits: int) -> None:
    print(
        f"log-probs + entropy memory ({tokens} tokens x vocab {vocab}, bf16 logits "
        f"{logits / 2**20:.0f} MiB):"
    )
    for variant, r in results.items():
        beyond_grad = r["backward"] - logits  # the gradient w.r.t. the logits
        print(
            f"  {variant:<8} forward extra {r['forward'] / logits:6.1%} of logits, "
            f"backward extra beyond the logits' gradient {beyond_grad / logits:6.1%}"
        )
    print("  goal: chunked extra <= 10% of the logits, forward and backward")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--probe", choices=["chunked", "plain"])
    parser.add_argument("--skip-steps", action="store_true")
    args = parser.parse_args()
    if args.probe:
        memory_probe(args.probe, args.tokens, args.vocab)
        return 0
    memory(args.tokens, args.vocab)
    if not args.skip_steps:
        step_times(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
