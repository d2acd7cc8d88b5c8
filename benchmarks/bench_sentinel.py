"""A collapse on purpose, with and without the collapse sentinel (docs/STABILITY.md).

    python benchmarks/bench_sentinel.py --seeds 0 1 2 --jobs 2 --out /tmp/bench_sentinel \
        --figure docs/figures/sentinel_collapse.png

For each seed, the default run (`gspo-train seed=S`, evaluation off) trains in chunks of
--chunk steps until it has learned (the mean reward of its last 20 steps >= --learned) or
reaches --max-prefix steps; call that step P (a checkpoint is there). Two copies of the run then
go on for --after steps with the learning rate of step P+1's first optimizer step x1000 (the
fault hook of tests/faults/inject: GSPO_FAULTS=lr_spike_at_optimizer_step=1,lr_spike_factor=
1000; the product has no test hooks): one with the sentinel (the default config), one with
stability.sentinel.enabled=false. The runs are deterministic, so both copies are the run that
would have gone on from P; the prefix is trained once. --jobs seeds run side by side (one
gspo-train process each).

Also reports, for each prefix (a healthy run learning from scratch), how close it came to each
default threshold of the sentinel: the largest reward fall below its moving average sustained
for 5 steps, the lowest entropy fraction sustained for 5 steps, the largest gradient-norm factor
sustained for 3 steps (read from the baselines the sentinel itself logged, stability/*_ema).
An arm whose run already reached its last step in --out is reused.

Prints one row per seed and arm (the reward of the last 20 steps, the lowest 20-step mean after
the injection, the rollbacks and where the sentinel fired), the machine's load average (the
2-core development machine is shared: seconds per step are not comparable across runs), and
writes summary.json and, with --figure, every run's reward in one figure (steps counted from the
injection).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULTS = REPO / "tests" / "faults" / "inject"
SPIKE = "lr_spike_at_optimizer_step=1,lr_spike_factor=1000"
COMMON = ["eval.every=0", "logging.progress=false", "trainer.save_every=25"]


def train(run_dir: Path, overrides: list[str], faults: str | None = None) -> float:
    """gspo-train into `run_dir` (resuming what is there); returns its wall time."""
    paths = [str(REPO)] + ([str(FAULTS)] if faults else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    env.pop("GSPO_FAULTS", None)
    if faults:
        env["GSPO_FAULTS"] = faults
    cmd = [sys.executable, "-m", "gspo_megatron.train", f"hydra.run.dir={run_dir}", *overrides]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_sentinel: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.monotonic() - started


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean_reward(rows: list[dict]) -> float:
    return sum(r["reward/mean"] for r in rows) / max(len(rows), 1)


def prefix(seed_dir: Path, seed: int, args) -> tuple[int, float]:
    """Train until learned (going on from what an earlier call left); (P, seconds)."""
    run, seconds = seed_dir / "prefix", 0.0
    steps = records(run)[-1]["step"] if (run / "metrics.jsonl").is_file() else 0

    def learned() -> bool:
        return mean_reward(records(run)[-20:]) >= args.learned

    while steps == 0 or (not learned() and steps < args.max_prefix):
        steps += args.chunk
        seconds += train(run, [f"seed={seed}", f"trainer.steps={steps}", *COMMON])
    return steps, seconds


def margins(rows: list[dict], warmup: int = 20) -> dict:
    """How close a healthy run came to the sentinel's signals at their default patience: each
    step's value against the baseline the sentinel logged the step before (what it compared
    with), the worst sustained over the patience. Also the steps with a signal and firings."""

    def sustained(values: list[float], patience: int, worst) -> float:
        runs = [values[i : i + patience] for i in range(len(values) - patience + 1)]
        return worst(max(r) if worst is min else min(r) for r in runs)

    pairs = list(zip(rows[warmup:], rows[warmup - 1 :], strict=False))
    drop = [b["stability/reward_ema"] - r["reward/mean"] for r, b in pairs]
    entropy = [r["actor/entropy"] / b["stability/entropy_ema"] for r, b in pairs]
    grads = [r["actor/grad_norm_max"] / b["stability/grad_norm_ema"] for r, b in pairs
             if b["stability/grad_norm_ema"] > 0]  # fmt: skip
    return {
        "steps": len(rows),
        "reward_drop_5": sustained(drop, 5, max),
        "entropy_fraction_5": sustained(entropy, 5, min),
        "grad_norm_factor_1": max(grads),
        "grad_norm_factor_3": sustained(grads, 3, max),
        "steps_with_a_signal": sum(r.get("stability/signals_active", 0) > 0 for r in rows),
        "firings": sum(bool(r.get("stability/sentinel_fired")) for r in rows),
    }


def arm(seed_dir: Path, seed: int, p: int, name: str, args) -> dict:
    run, last = seed_dir / name, p + args.after
    seconds = float("nan")  # a reused arm
    if not (run / "metrics.jsonl").is_file() or records(run)[-1]["step"] != last:
        if run.exists():
            shutil.rmtree(run)
        shutil.copytree(seed_dir / "prefix", run)
        extra = [] if name == "with" else ["stability.sentinel.enabled=false"]
        seconds = train(
            run, [f"seed={seed}", f"trainer.steps={last}", *COMMON, *extra], faults=SPIKE
        )
    rows = records(run)
    side = run / "metrics.superseded.jsonl"
    replaced = [json.loads(x) for x in side.read_text().splitlines()] if side.is_file() else []
    after = [r for r in rows if r["step"] > p]
    windows = [mean_reward(after[i : i + 20]) for i in range(0, max(len(after) - 19, 1))]
    rollbacks_file = run / "rollbacks.json"
    rollbacks = json.loads(rollbacks_file.read_text()) if rollbacks_file.is_file() else []
    return {
        "seed": seed,
        "arm": name,
        "injected_at": p + 1,
        "last20_reward": mean_reward(rows[-20:]),
        "lowest20_after": min(windows),
        "rollbacks": [
            {k: r[k] for k in ("fired_at", "since", "to_step", "signals", "status")}
            for r in rollbacks
        ],
        "fired": [r["step"] for r in rows if r.get("stability/sentinel_fired")],
        "seconds": seconds,
        "seconds_per_step": seconds / args.after,
        "load_after": os.getloadavg(),
        "steps": [r["step"] for r in rows],
        "reward": [r["reward/mean"] for r in rows],
        # the records a rollback replaced (the steps up to the firing)
        "replaced_steps": [r["step"] for r in replaced if r["step"] > p],
        "replaced_reward": [r["reward/mean"] for r in replaced if r["step"] > p],
    }


def run_seed(seed: int, args) -> list[dict]:
    """The prefix of `seed`, then both arms from it; prints a line per arm."""
    seed_dir = args.out / f"seed{seed}"
    p, seconds = prefix(seed_dir, seed, args)
    healthy = margins(records(seed_dir / "prefix"))
    print(
        f"seed {seed}: learned by step {p} ({seconds:.0f} s); healthy run: reward "
        f"{healthy['reward_drop_5']:.3f} below its average for 5 steps, entropy "
        f"{healthy['entropy_fraction_5']:.3f} of it for 5 steps, grad norm "
        f"{healthy['grad_norm_factor_1']:.1f}x for 1 step, {healthy['grad_norm_factor_3']:.2f}x "
        f"for 3; {healthy['steps_with_a_signal']} steps with a signal, "
        f"{healthy['firings']} firings",
        flush=True,
    )
    results = []
    for name in ("without", "with"):
        r = arm(seed_dir, seed, p, name, args)
        r["healthy_prefix"] = healthy
        results.append(r)
        print(
            f"seed {seed} sentinel {'on ' if name == 'with' else 'off'}: injected at step "
            f"{r['injected_at']}, reward of the last 20 steps {r['last20_reward']:.3f}, "
            f"lowest 20-step mean after {r['lowest20_after']:.3f}, rollbacks "
            f"{[(b['fired_at'], b['to_step']) for b in r['rollbacks']]}, fired at "
            f"{r['fired']}, {r['seconds_per_step']:.2f} s/step, load {r['load_after'][1]:.1f}",
            flush=True,
        )
    return results


def smooth(values: list[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in
            range(len(values))]  # fmt: skip


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    seeds = sorted({r["seed"] for r in results})
    for r in results:
        p = r["injected_at"] - 1
        color = colors[seeds.index(r["seed"])]
        x = [s - p for s in r["steps"] if s > p - 150]
        y = smooth([v for s, v in zip(r["steps"], r["reward"], strict=True) if s > p - 150])
        style = "-" if r["arm"] == "with" else "--"
        label = f"seed {r['seed']}, sentinel {'on' if r['arm'] == 'with' else 'off'}"
        ax.plot(x, y, style, color=color, label=label, linewidth=1.2)
        for fired in r["fired"]:  # sentinel off: where it says it would roll back
            ax.plot(fired - p, y[x.index(fired - p)], "x", color=color, markersize=10, mew=2)
        if r["replaced_steps"]:  # what the rollback replaced: the fall, up to the firing
            before = [(s, v) for s, v in zip(r["steps"], r["reward"], strict=True) if s <= p]
            steps = [s for s, _ in before[-4:]] + r["replaced_steps"]
            y = smooth([v for _, v in before[-4:]] + r["replaced_reward"])[4:]
            ax.plot([s - p for s in steps[4:]], y, ":", color=color, linewidth=1.2)
            ax.plot(steps[-1] - p, y[-1], "x", color=color, markersize=10, mew=2, zorder=5)
    ax.axvline(0.5, color="grey", linewidth=0.8)
    ax.text(3, 0.45, "step P+1: LR x1000 for one optimizer step", fontsize=8, color="grey")
    ax.text(9, 0.3, "x: the sentinel fires (on: rolls back to P;\noff: only says so)", fontsize=8)
    ax.axhline(0.8, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel(
        "RL steps since P, the last step before the injection (dotted: the records a rollback "
        "replaced, under the dashed ones)"
    )
    ax.set_ylabel("reward/mean (5-step trailing mean)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    ax.set_title("A collapse on purpose: the default run with and without the collapse sentinel")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_sentinel"))
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--learned", type=float, default=0.8)
    parser.add_argument("--max-prefix", type=int, default=800)
    parser.add_argument("--after", type=int, default=150)
    parser.add_argument("--jobs", type=int, default=1, help="seeds run side by side")
    parser.add_argument("--figure", type=Path)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        per_seed = list(pool.map(lambda seed: run_seed(seed, args), args.seeds))
    results = [r for rows in per_seed for r in rows]
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    summary = {"results": results, "load_before": load_before, "load_after": load_after,
               "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.figure:
        plot(results, args.figure)
        print(args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
