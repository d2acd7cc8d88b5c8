"""Plot metrics.jsonl of one or several runs, overlaid, as PNG figures.

    python tools/plot_metrics.py outputs/run_a outputs/run_b --out plots/

Writes one PNG per metric family (reward, clip fraction, KL, response length, route changes,
evaluation, entropy, multi-turn episodes, PPO's critic, and the stability telemetry: the
rollout/trainer mismatch, route flips per layer, the clip fraction by version lag and by
response length, and what the collapse sentinel watches), each with every run as a line.
Rollbacks are dashed vertical lines at the step each run went back to. `--smooth N` averages
over a trailing window.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gspo_megatron.files import staged  # noqa: E402

FIGURES = {
    "reward": ["reward/mean", "reward/accuracy"],
    "clip_fraction": ["actor/clip_fraction", "actor/seq_clip_fraction"],
    "kl": ["actor/approx_kl"],
    "response_length": ["response/length_mean"],
    "route_change": ["moe/route_change_fraction"],
    "eval": [],  # every benchmark's avg@n and pass@k (eval/<metric>, eval/<name>/<metric>)
    "entropy": ["actor/entropy"],
    "episodes": ["env/tool_call_rate", "env/turns_mean", "env/solved_with_tools"],
    "critic": ["critic/loss", "critic/explained_variance"],
    "mismatch": ["mismatch/k3_kl", "mismatch/tokens_past_threshold"],
    # the families below take every key with the prefix (per layer, per bucket)
    "route_flips": ["moe/route_flips", "moe/replay_coverage", "moe/route_flips/layer_"],
    "clip_by_lag": ["actor/clip_fraction_lag_"],
    "clip_by_length": ["actor/clip_fraction_length_"],
    "sentinel": [
        "reward/mean",
        "stability/reward_ema",
        "actor/entropy",
        "actor/grad_norm_max",
        "stability/signals_active",
    ],
}
# Keys ending in "_" or "/" in FIGURES stand for every logged key they start with.
_ROLLED_BACK = "stability/rolled_back_from"


def load_run(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is this a gspo-train run directory?)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON record ({err})") from err
    return records


def smooth(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _expand(key: str, logged: set[str]) -> list[str]:
    """`key` when it is logged; a prefix key (ending in "_" or "/"): every logged key it starts
    with, numbers in order (layer_2 before layer_10)."""
    if not key.endswith(("_", "/")):
        return [key] if key in logged else []
    found = [k for k in logged if k.startswith(key)]
    return sorted(found, key=lambda k: (len(k), k))


def _is_benchmark_accuracy(key: str) -> bool:
    return key.startswith("eval/") and key.rsplit("/", 1)[1].startswith(("avg@", "pass@"))


def plot(runs: dict[str, list[dict]], out_dir: Path, window: int) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    logged = {k for records in runs.values() for r in records for k in r}
    for figure, keys in FIGURES.items():
        if figure == "eval":
            keys = sorted(k for k in logged if _is_benchmark_accuracy(k))
        present = [k for key in keys for k in _expand(key, logged)]
        if not present:
            continue
        fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.5), squeeze=False)
        for ax, key in zip(axes[0], present, strict=True):
            for label, records in runs.items():
                points = [(r["step"], r[key]) for r in records if key in r]
                if points:
                    steps, values = zip(*points, strict=True)
                    ax.plot(steps, smooth(list(values), window), label=label)
            for records in runs.values():
                for r in records:
                    if _ROLLED_BACK in r:  # the first record after a rollback to step - 1
                        ax.axvline(r["step"] - 1, color="grey", linestyle="--", linewidth=0.8)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{figure}.png"
        with staged(path) as tmp:  # a figure open in a viewer is replaced whole
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("plots"))
    parser.add_argument("--smooth", type=int, default=1, help="trailing average window (steps)")
    args = parser.parse_args(argv)
    try:
        runs = {str(path): load_run(path) for path in args.runs}
    except (FileNotFoundError, ValueError) as err:
        print(f"plot_metrics: {err}", file=sys.stderr)
        return 2
    for path in plot(runs, args.out, args.smooth):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
