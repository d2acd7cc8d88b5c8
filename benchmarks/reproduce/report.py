"""Figures and a summary table for a reproduction experiment, from the runs' metrics.jsonl.

    python benchmarks/reproduce/report.py all --out outputs/reproduce --figures docs/figures

(run.py calls this after every run.) Each figure shows, per method, the mean over seeds as a
line and the min-max over seeds as a band; per-step training curves are first averaged over a
trailing window (the figure's `smooth`). The summary (markdown and JSON, in --out) gives each
quantity as mean ± std over seeds, with the per-seed values in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from experiments import EXPERIMENTS, METHODS  # noqa: E402
from plot_metrics import smooth  # noqa: E402
from stats import compare  # noqa: E402

LAST_STEPS = 30  # "final" training values: mean over the last 30 steps
LAST_EVALS = 3  # "final" held-out values: mean over the last 3 evaluations
HELDOUT_TARGET = 0.5  # steps to reach this held-out pass@1


def load_metrics(directory: Path) -> list[dict]:
    path = directory / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_complete(directory: Path, steps: int) -> bool:
    records = load_metrics(directory)
    return bool(records) and records[-1].get("step") == steps and len(records) == steps


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if key in r and _finite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def run_summary(records: list[dict]) -> dict[str, float | None]:
    """The per-run quantities of the summary table."""
    _, reward = series(records, "reward/mean")
    _, accuracy = series(records, "reward/accuracy")
    eval_steps, heldout = series(records, "eval/pass@1")
    _, heldout_reward = series(records, "eval/reward_mean")
    reached = [s for s, v in zip(eval_steps, heldout, strict=True) if v >= HELDOUT_TARGET]

    def mean_of(key: str) -> float | None:
        values = series(records, key)[1]
        return statistics.fmean(values) if values else None

    _, step_times = series(records, "time/step")
    return {
        "reward_final": statistics.fmean(reward[-LAST_STEPS:]) if reward else None,
        "reward_mean_all_steps": statistics.fmean(reward) if reward else None,
        "heldout_reward_final": statistics.fmean(heldout_reward[-LAST_EVALS:])
        if heldout_reward
        else None,
        "heldout_reward_all_evals": statistics.fmean(heldout_reward) if heldout_reward else None,
        "accuracy_final": statistics.fmean(accuracy[-LAST_STEPS:]) if accuracy else None,
        "heldout_final": statistics.fmean(heldout[-LAST_EVALS:]) if heldout else None,
        "heldout_best": max(heldout) if heldout else None,
        f"steps_to_heldout_{HELDOUT_TARGET}": float(reached[0]) if reached else None,
        "clip_fraction": mean_of("actor/clip_fraction"),
        "seq_clip_fraction": mean_of("actor/seq_clip_fraction"),
        "route_change_fraction": mean_of("moe/route_change_fraction"),
        "route_change_first_100": _mean_window(records, "moe/route_change_fraction", 1, 100),
        "s_per_step_median": statistics.median(step_times) if step_times else None,
    }


def collect(
    methods: tuple[str, ...], out: Path, seeds: list[int], steps: int
) -> dict[str, dict[int, list[dict]]]:
    """Complete runs only: method -> seed -> records."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for method in methods:
        for seed in seeds:
            directory = out / method / f"seed{seed}"
            if run_complete(directory, steps):
                runs.setdefault(method, {})[seed] = load_metrics(directory)
    return runs


def plot_figure(runs, figure, path: Path, steps: int) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for method, by_seed in runs.items():
        if method in figure.exclude:
            continue
        curves = []
        for records in by_seed.values():
            xs, ys = series(records, figure.metric)
            if xs:
                curves.append((xs, smooth(ys, figure.smooth)))
        if not curves:
            continue
        common = sorted(set.intersection(*(set(xs) for xs, _ in curves)))
        columns = [[dict(zip(xs, ys, strict=True))[s] for s in common] for xs, ys in curves]
        by_step = list(zip(*columns, strict=True))
        mean = [statistics.fmean(v) for v in by_step]
        low, high = [min(v) for v in by_step], [max(v) for v in by_step]
        if figure.log_y:
            floor = 1e-5
            mean, low, high = ([max(v, floor) for v in vs] for vs in (mean, low, high))
        spec = METHODS[method]
        ax.plot(common, mean, color=spec.color, label=f"{spec.label} (n={len(curves)})")
        ax.fill_between(common, low, high, color=spec.color, alpha=0.18, linewidth=0)
    if figure.log_y:
        ax.set_yscale("log")
    smoothing = f", {figure.smooth}-step trailing mean" if figure.smooth > 1 else ""
    ax.set_title(f"{figure.title}\nmean over seeds, band = min-max{smoothing}", fontsize=10)
    ax.set_xlabel(f"RL step (128 rollout samples, 4 optimizer steps each; {steps} steps)")
    ax.set_ylabel(figure.metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(runs) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for method, by_seed in runs.items():
        per_seed = {seed: run_summary(records) for seed, records in sorted(by_seed.items())}
        keys = next(iter(per_seed.values())).keys()
        stats = {}
        for key in keys:
            values = [v[key] for v in per_seed.values() if v[key] is not None]
            stats[key] = {
                "mean": statistics.fmean(values) if values else None,
                "std": statistics.stdev(values) if len(values) > 1 else 0.0 if values else None,
                "n": len(values),
            }
        table[method] = {"seeds": sorted(by_seed), "stats": stats, "per_seed": per_seed}
    return table


def _fmt(stat: dict, key: str) -> str:
    if stat["mean"] is None:
        return "–"
    small = key in (
        "clip_fraction",
        "seq_clip_fraction",
        "route_change_fraction",
        "route_change_first_100",
    )
    fmt = "{:.2e}" if small and abs(stat["mean"]) < 1e-2 else "{:.3f}"
    if key.startswith("steps_to"):
        fmt = "{:.0f}"
    text = fmt.format(stat["mean"])
    if stat["n"] > 1:
        text += " ± " + fmt.format(stat["std"])
    return text


COLUMNS = [
    ("reward_final", f"train reward (last {LAST_STEPS})"),
    ("heldout_reward_final", f"held-out reward (last {LAST_EVALS} evals)"),
    ("heldout_final", f"held-out pass@1 (last {LAST_EVALS} evals)"),
    ("reward_mean_all_steps", "train reward (mean, all steps)"),
    (f"steps_to_heldout_{HELDOUT_TARGET}", f"steps to held-out ≥ {HELDOUT_TARGET}"),
    ("clip_fraction", "token clip fraction"),
    ("seq_clip_fraction", "seq clip fraction"),
    ("route_change_fraction", "route-change fraction"),
    ("route_change_first_100", "route-change, steps 1-100"),
    ("s_per_step_median", "s/step (median)"),
]


def markdown_table(table: dict[str, dict]) -> str:
    header = "| method | seeds | " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "---|" * (len(COLUMNS) + 2)
    rows = [header, rule]
    for method, entry in table.items():
        cells = []
        for key, _ in COLUMNS:
            stat = entry["stats"][key]
            cell = _fmt(stat, key)
            if stat["n"] and stat["n"] < len(entry["seeds"]):
                cell += f" ({stat['n']}/{len(entry['seeds'])} seeds)"
            cells.append(cell)
        seeds = ",".join(str(s) for s in entry["seeds"])
        rows.append(f"| {METHODS[method].label} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_report(
    experiment_name: str, out: Path, seeds: list[int], steps: int, figures: Path
) -> list[Path]:
    experiment = EXPERIMENTS[experiment_name]
    runs = collect(experiment.methods, out, seeds, steps)
    written: list[Path] = []
    if not runs:
        return written
    for figure in experiment.figures:
        path = figures / f"{experiment_name}_{figure.name}.png"
        plot_figure(runs, figure, path, steps)
        written.append(path)
    table = summarize(runs)
    summary_json = out / f"{experiment_name}_summary.json"
    summary_json.write_text(json.dumps({"steps": steps, "methods": table}, indent=2))
    summary_md = out / f"{experiment_name}_summary.md"
    missing = [
        f"{m} seed {s}" for m in experiment.methods for s in seeds if s not in runs.get(m, {})
    ]
    lines = [
        f"# {experiment_name}: {experiment.claim}",
        "",
        f"{steps} RL steps per run; mean ± std over seeds.",
        "",
        markdown_table(table),
        "",
    ]
    if missing:
        lines += [f"Not finished yet: {', '.join(missing)}.", ""]
    if experiment.comparisons:
        decided = decide(experiment, table)
        summary_json.write_text(
            json.dumps({"steps": steps, "methods": table, "comparisons": decided}, indent=2)
        )
        lines += [comparisons_table(decided), ""]
    summary_md.write_text("\n".join(lines))
    written += [summary_md, summary_json]
    return written


# What a comparison is decided on: the area under the training reward curve (its mean over
# all steps), and the held-out mean reward of the last evaluations and over all of them.
DECIDING = ("reward_mean_all_steps", "heldout_reward_final", "heldout_reward_all_evals")


# What a verdict on a test means for a claim "A > B", "A = B" and "A >= B" (A is not worse).
_FOR_GREATER = {
    "A > B": "holds",
    "A < B": "does not hold (A < B)",
    "equivalent": "does not hold (equal within the margin)",
    "undecided": "undecided",
}
_FOR_EQUAL = {
    "equivalent": "holds (equal within the margin)",
    "A > B": "does not hold (they differ)",
    "A < B": "does not hold (they differ)",
    "undecided": "undecided",
}
_FOR_NOT_WORSE = {
    "A > B": "holds (A > B)",
    "equivalent": "holds (equal within the margin)",
    "A < B": "does not hold (A < B)",
    "undecided": "undecided",
}
_MEANINGS = {"A > B": _FOR_GREATER, "equal": _FOR_EQUAL, "A >= B": _FOR_NOT_WORSE}


def decide(experiment, table: dict[str, dict]) -> list[dict]:
    """Each comparison on each deciding quantity: the test and what it says about the claim."""
    out = []
    for c in experiment.comparisons:
        if c.a not in table or c.b not in table:
            continue
        for key in DECIDING:
            a = [v[key] for v in table[c.a]["per_seed"].values() if v[key] is not None]
            b = [v[key] for v in table[c.b]["per_seed"].values() if v[key] is not None]
            if len(a) < 2 or len(b) < 2:
                continue
            test = compare(a, b, margin=experiment.margin)
            meaning = _MEANINGS[c.expect]
            test["test"] = test.pop("verdict")
            out.append({"claim": c.claim, "a": c.a, "b": c.b, "quantity": key, **test,
                        "verdict": meaning[test["test"]]})  # fmt: skip
    return out


def comparisons_table(decided: list[dict]) -> str:
    rows = [
        "| claim | quantity | A − B (95% CI) | p (permutation) | seeds (A, B) | verdict | "
        "difference these seeds detect (power 0.8) | seeds per method to detect A − B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in decided:
        need = d["seeds_for_power_0.8"]
        rows.append(
            f"| {d['claim']} | {d['quantity']} | {d['difference']:+.3f} "
            f"({d['ci_low']:+.3f}, {d['ci_high']:+.3f}) | {d['p']:.4f} | {d['n_a']}, {d['n_b']} "
            f"| {d['verdict']} | {d['detectable_at_power_0.8']:.3f} | {need if need > 0 else '–'} |"
        )
    return "\n".join(rows)


def _mean_window(records: list[dict], key: str, first: int, last: int) -> float | None:
    values = [v for s, v in zip(*series(records, key), strict=True) if first <= s <= last]
    return statistics.fmean(values) if values else None


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the experiment's")
    parser.add_argument("--steps", type=int, help="default: the experiment's")
    parser.add_argument("--out", type=Path, default=Path("outputs/reproduce"))
    parser.add_argument("--figures", type=Path, default=None)
    args = parser.parse_args(argv)
    experiment = EXPERIMENTS[args.experiment]
    out = args.out / experiment.runs
    figures = args.figures or out / "figures"
    seeds, steps = args.seeds or list(experiment.seeds), args.steps or experiment.steps
    for path in write_report(args.experiment, out, seeds, steps, figures):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
