"""Forward + backward time of every policy loss relative to ``grpo``, measured side by side.

    python benchmarks/bench_losses.py                  # B=256, T=8192, CPU, float32
    python benchmarks/bench_losses.py --device cuda --repeats 20

Each round times every loss once, in a rotated order, so drift of the machine (other jobs,
frequency) hits all losses alike; the table reports each loss's median over the rounds and its
ratio to grpo's median. The timed step is what the engine runs per micro-batch:
``policy_loss_terms`` (input checks, metrics included) -> ``loss()`` -> gradient w.r.t. logprobs.
Goal from the design: gspo <= 1.2x grpo.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gspo_megatron.algorithms import POLICY_LOSSES, policy_loss_terms


def make_inputs(batch: int, length: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, length, generator=g) * 3.0
    old = logp + 0.1 * torch.randn(batch, length, generator=g)
    lengths = torch.randint(length // 8, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    adv = torch.randn(batch, generator=g)
    leaf = logp.to(device=device, dtype=dtype).requires_grad_()
    return leaf, old.to(device=device, dtype=dtype), adv.to(device), mask.to(device)


def hparams(name: str, length: int) -> dict:
    return {"max_response_length": length} if name == "dr_grpo" else {}


def step(name: str, inputs, length: int, sync) -> float:
    logp, old, adv, mask = inputs
    sync()
    start = time.perf_counter()
    terms = policy_loss_terms(name, logp, old, adv, mask, **hparams(name, length))
    (grad,) = torch.autograd.grad(terms.loss(), logp)
    sync()
    elapsed = time.perf_counter() - start
    del grad
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    inputs = make_inputs(args.batch, args.length, args.device, dtype)
    names = list(POLICY_LOSSES)
    for name in names:  # warm-up (allocator, kernels)
        step(name, inputs, args.length, sync)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(step(name, inputs, args.length, sync))

    threads = torch.get_num_threads()
    tokens = int(inputs[3].sum())
    print(
        f"policy loss forward+backward: B={args.batch} T={args.length} ({tokens} response "
        f"tokens) {args.dtype} on {args.device}, torch {torch.__version__}, {threads} threads, "
        f"median of {args.repeats} interleaved rounds"
    )
    base = statistics.median(times["grpo"])
    print(f"| {'loss':<11} | {'median ms':>9} | {'min ms':>8} | {'vs grpo':>7} |")
    print(f"|{'-' * 13}|{'-' * 10}:|{'-' * 9}:|{'-' * 8}:|")
    for name in names:
        med, low = statistics.median(times[name]), min(times[name])
        print(f"| {name:<11} | {med * 1e3:>9.1f} | {low * 1e3:>8.1f} | {med / base:>6.2f}x |")


if __name__ == "__main__":
    main()
