"""The synthetic code task learns: `gspo-train +experiment=code_cpu` for several seeds, one after
another, then `gspo-eval` pass@k of the first seed's final checkpoint.

    python benchmarks/bench_code_task.py                      # seeds 0 1 2, the preset's steps
    python benchmarks/bench_code_task.py --seeds 0 --steps 100 --out outputs/code_task

Per seed the table gives the mean reward of the last 20 steps, the held-out greedy evaluation
at the end (mean reward, pass@1), the first step at which the 20-step mean reward reaches 0.8
with the wall time at that step (start-up included), the share of steps whose programs the
outcome cache answered, and the run's wall time. Then the first seed's final checkpoint is
evaluated by gspo-eval on the held-out prompts with `--samples` sampled responses each
(temperature 1), giving pass@k. Run directories go under --out; the machine's load average is
printed with the figures (runs on a shared machine are slower, not different).
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
QUIET = ["logging.progress=false", "logging.tensorboard=false"]


def run(module: str, directory: Path, overrides: list[str]) -> float:
    """One gspo-train / gspo-eval process in a fresh directory; its wall time."""
    cmd = [sys.executable, "-m", module, f"hydra.run.dir={directory}", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return time.perf_counter() - started


def learn(directory: Path, seed: int, steps: int | None) -> dict:
    if (directory / "metrics.jsonl").exists():
        raise SystemExit(f"{directory} holds a run already; use a new --out")
    overrides = ["+experiment=code_cpu", f"seed={seed}", *QUIET]
    overrides += [f"trainer.steps={steps}"] if steps else []
    load = os.getloadavg()[0]
    wall = run("gspo_megatron.train", directory, overrides)
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in records]
    window = [statistics.fmean(rewards[max(0, i - 19) : i + 1]) for i in range(len(rewards))]
    reached = next((i for i, w in enumerate(window) if i >= 19 and w >= 0.8), None)
    start_up = wall - sum(r["time/step"] for r in records)
    evals = [r for r in records if "eval/reward_mean" in r]
    return {
        "seed": seed,
        "steps": len(records),
        "reward_last_20": window[-1],
        "eval_reward": evals[-1]["eval/reward_mean"],
        "eval_pass@1": evals[-1]["eval/pass@1"],
        "step_0.8": None if reached is None else records[reached]["step"],
        "minutes_0.8": None
        if reached is None
        else (start_up + sum(r["time/step"] for r in records[: reached + 1])) / 60,
        "step_s": statistics.median(r["time/step"] for r in records),
        "minutes": wall / 60,
        "load_before": load,
        "load_after": os.getloadavg()[0],
        "checkpoint": str(max((directory / "checkpoints").iterdir())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's")
    parser.add_argument("--samples", type=int, default=16, help="gspo-eval samples per prompt")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_code_task")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        rows.append(learn(out / f"seed{seed}", seed, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    first = rows[0]
    ks = sorted({1, 4, args.samples} & set(range(1, args.samples + 1)))
    heldout = [
        f"eval.heldout.samples={args.samples}",
        "eval.heldout.temperature=1.0",
        f"eval.heldout.ks=[{','.join(map(str, ks))}]",
    ]
    eval_dir = out / f"eval_seed{first['seed']}"
    model = f"model.init_from={first['checkpoint']}"
    run("gspo_megatron.evaluate", eval_dir, ["+experiment=code_cpu", f"seed={first['seed']}",
        model, *heldout, *QUIET])  # fmt: skip
    summary = json.loads((eval_dir / "summary.json").read_text())
    (out / "results.json").write_text(json.dumps({"runs": rows, "eval": summary}, indent=2))

    print(
        "\n| seed | reward, last 20 steps | held-out reward / pass@1 (greedy, end) | first "
        "step with 20-step mean ≥ 0.8 (wall min) | median s/step | wall min | load avg |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        reached = "-" if r["step_0.8"] is None else f"{r['step_0.8']} ({r['minutes_0.8']:.1f})"
        print(f"| {r['seed']} | {r['reward_last_20']:.3f} | {r['eval_reward']:.3f} / "
              f"{r['eval_pass@1']:.3f} | {reached} | {r['step_s']:.2f} | {r['minutes']:.1f} | "
              f"{r['load_before']:.0f}-{r['load_after']:.0f} |")  # fmt: skip
    print(f"\ngspo-eval {first['checkpoint']}: {args.samples} samples per held-out prompt, "
          "temperature 1")  # fmt: skip
    print(json.dumps(summary, indent=2)[:3000])


if __name__ == "__main__":
    main()
