"""rollout.mode sync vs one_step_off vs async, side by side in one run (CPU, gspo-train).

    python benchmarks/bench_async.py                   # throughput: steps/s of each mode
    python benchmarks/bench_async.py --learn           # the default task in each mode, 3 seeds

Throughput: the default model and task with longer responses (--new-tokens, default 48), where
generation and training take comparable time on CPU; each mode trains --steps steps (default
30) from the same seed, one after another, and the mean of time/step after two warm-up steps
gives steps/s. The table prints each mode's ratio to sync and its reward trajectory (mean
reward of the first and last thirds), so a speed-up bought with worse learning shows.

Learn: the default configuration (800 steps) in each mode and seed, one run after another; the
table prints the final reward (mean of the last 20 steps), held-out pass@1 at the end, and the
first step at which the 20-step mean reward reaches 0.8.

Every run is a `gspo-train` process with the machine's default threads; the generator process
of one_step_off and async uses one thread. Run directories go under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "sync": ["rollout.mode=sync"],
    "one_step_off": ["rollout.mode=one_step_off"],
    "async": ["rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2"],
}
QUIET = ["logging.progress=false", "logging.tensorboard=false"]


def train(directory: Path, overrides: list[str]) -> list[dict]:
    """One gspo-train run (fresh directory); returns its metrics records."""
    if (directory / "metrics.jsonl").exists():
        raise SystemExit(f"{directory} holds a run already; use a new --out")
    cmd = [sys.executable, "-m", "gspo_megatron.train", f"hydra.run.dir={directory}", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    print(f"  {directory.name}: {time.perf_counter() - started:.0f} s", flush=True)
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def throughput(args) -> None:
    common = [
        f"rollout.max_new_tokens={args.new_tokens}",
        f"trainer.steps={args.steps}",
        "eval.every=0",
        f"seed={args.seed}",
        *QUIET,
    ]
    rows = {}
    for mode, overrides in MODES.items():
        records = train(args.out / f"throughput_{mode}", [*common, *overrides])
        step_s = statistics.fmean(r["time/step"] for r in records[2:])
        third = max(len(records) // 3, 1)
        rows[mode] = {
            "steps_per_s": 1.0 / step_s,
            "generate_s": statistics.fmean(r["time/generate"] for r in records[2:]),
            "train_s": statistics.fmean(
                r["time/train"] + r["time/old_logprobs"] for r in records[2:]
            ),
            "reward_first": statistics.fmean(r["reward/mean"] for r in records[:third]),
            "reward_last": statistics.fmean(r["reward/mean"] for r in records[-third:]),
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in records),
            "weight_swaps": sum(r.get("async/weight_swaps", 0.0) for r in records),
        }
    base = rows["sync"]["steps_per_s"]
    print(f"\nthroughput: {args.steps} steps, max_new_tokens={args.new_tokens}, seed {args.seed}")
    print(
        f"{'mode':<13}{'steps/s':>9}{'x sync':>8}{'wait gen s':>11}{'train s':>9}"
        f"{'reward 1st/3':>14}{'last/3':>8}{'stale max':>10}{'swaps':>7}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<13}{r['steps_per_s']:>9.3f}{r['steps_per_s'] / base:>8.2f}"
            f"{r['generate_s']:>11.3f}{r['train_s']:>9.3f}{r['reward_first']:>14.3f}"
            f"{r['reward_last']:>8.3f}{r['staleness_max']:>10.0f}{r['weight_swaps']:>7.0f}"
        )
    (args.out / "throughput.json").write_text(json.dumps(rows, indent=2))


def learn(args) -> None:
    rows = []
    for mode, overrides in MODES.items():
        for seed in args.seeds:
            directory = args.out / f"learn_{mode}_seed{seed}"
            common = [f"trainer.steps={args.steps}", f"seed={seed}", *QUIET]
            records = train(directory, [*common, *overrides])
            rewards = [r["reward/mean"] for r in records]
            window = [
                statistics.fmean(rewards[max(0, i - 19) : i + 1]) for i in range(len(rewards))
            ]
            reached = next((i + 1 for i, w in enumerate(window) if i >= 19 and w >= 0.8), None)
            evals = [r["eval/pass@1"] for r in records if "eval/pass@1" in r]
            rows.append(
                {
                    "mode": mode,
                    "seed": seed,
                    "reward_final": window[-1],
                    "pass@1_final": evals[-1] if evals else None,
                    "step_reward_0.8": reached,
                    "staleness_max": max(r.get("async/staleness_max", 0.0) for r in records),
                }
            )
    print(f"\nthe default task, {args.steps} steps")
    print(f"{'mode':<13}{'seed':>5}{'reward (last 20)':>18}{'pass@1':>8}{'step >= 0.8':>12}")
    for r in rows:
        reached = "-" if r["step_reward_0.8"] is None else str(r["step_reward_0.8"])
        held = "-" if r["pass@1_final"] is None else f"{r['pass@1_final']:.3f}"
        print(f"{r['mode']:<13}{r['seed']:>5}{r['reward_final']:>18.3f}{held:>8}{reached:>12}")
    (args.out / "learn.json").write_text(json.dumps(rows, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learn", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="30 (throughput), 800 (learn)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_async")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.learn:
        args.steps = args.steps or 800
        learn(args)
    else:
        args.steps = args.steps or 30
        throughput(args)


if __name__ == "__main__":
    main()
