"""Run one reproduction experiment: its methods x seeds with equal compute, then the report.

    python benchmarks/reproduce/run.py efficiency       # claim (a): GSPO vs GRPO, GSPO-token, SAPO
    python benchmarks/reproduce/run.py clipping         # claim (b): clipped-token fractions
    python benchmarks/reproduce/run.py routing_replay   # claim (c): GRPO +/- Routing Replay, GSPO
    python benchmarks/reproduce/run.py all --figures docs/figures   # the whole sweep

Options: --seeds (default: the experiment's, 0 1 2 3 4 for most), --steps (default: the
experiment's, 600 for most), --out outputs/reproduce (run directories <out>/<method>/seed<k>,
shared by the experiments that run the common setup; an experiment with a setup of its own
keeps its runs in <out>/<its name>/: a finished run is not trained again, an unfinished one
resumes from its checkpoint), --figures DIR (default <out>/figures),
--report-only (no training), --smoke (a couple of steps with a small batch, for CI). Extra
arguments are Hydra overrides applied to every run (they are part of the run's identity: use a
new --out when you change them).

Runs go in seed-major order (every method's seed 0 first), each a `gspo-train` process,
--jobs of them at once (default 1; give each its share of the cores with OMP_NUM_THREADS); the
report (figures with mean and min-max over seeds, a summary table) is rewritten after every
run, so partial results can be read while the sweep goes on.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiments import COMMON, EXPERIMENTS, METHODS, SMOKE  # noqa: E402
from report import run_complete, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN_RECORD = "repro_run.json"


def run_dir(out: Path, method: str, seed: int) -> Path:
    return out / method / f"seed{seed}"


def train_command(method: str, seed: int, steps: int, directory: Path, extra: list[str]) -> list:
    return [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        f"hydra.run.dir={directory}",
        *COMMON,
        *METHODS[method].overrides,
        *extra,
        f"trainer.steps={steps}",
        f"seed={seed}",
    ]


def train_one(method: str, seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    """Train (or resume) one run; returns its record (wall time, command, exit status)."""
    directory = run_dir(out, method, seed)
    directory.mkdir(parents=True, exist_ok=True)
    metrics = directory / "metrics.jsonl"
    if metrics.is_file() and not any((directory / "checkpoints").glob("step_*")):
        # A run killed before its first checkpoint starts again from step 0, and gspo-train
        # appends to an existing metrics.jsonl: drop the stale records.
        metrics.unlink()
    cmd = train_command(method, seed, steps, directory, extra)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    started = time.perf_counter()
    with open(directory / "train.log", "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    record = {
        "method": method,
        "seed": seed,
        "steps": steps,
        "command": " ".join(cmd[1:]),
        "wall_s": time.perf_counter() - started,
        "returncode": proc.returncode,
    }
    previous = directory / RUN_RECORD
    if previous.is_file():  # a resumed run: add up the wall time of every attempt
        record["wall_s"] += json.loads(previous.read_text()).get("wall_s", 0.0)
    previous.write_text(json.dumps(record, indent=2))
    if proc.returncode != 0:
        tail = (directory / "train.log").read_text()[-3000:]
        raise RuntimeError(f"{method} seed {seed} exited {proc.returncode}:\n{tail}")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the experiment's")
    parser.add_argument("--steps", type=int, help="default: the experiment's")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "reproduce")
    parser.add_argument("--figures", type=Path, default=None, help="default: <out>/figures")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny batches, for CI")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        parser.error(f"unrecognized arguments {bad} (Hydra overrides look like key=value)")
    experiment = EXPERIMENTS[args.experiment]
    args.seeds = args.seeds or list(experiment.seeds)
    args.steps = args.steps or experiment.steps
    extra = [*experiment.extra, *(SMOKE if args.smoke else ()), *overrides]
    out = (args.out / experiment.runs).resolve()
    figures = (args.figures or out / "figures").resolve()

    def report() -> None:
        written = write_report(args.experiment, out, args.seeds, args.steps, figures)
        print(f"[reproduce] report: {', '.join(str(p) for p in written)}", flush=True)

    if not args.report_only:
        todo = [
            (m, s)
            for s in args.seeds
            for m in experiment.methods
            if not run_complete(run_dir(out, m, s), args.steps)
        ]
        print(f"[reproduce] {args.experiment}: {len(todo)} run(s) to train", flush=True)
        if args.jobs < 1:
            parser.error(f"--jobs must be >= 1, got {args.jobs}")
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            running = {
                pool.submit(train_one, method, seed, args.steps, out, extra): (method, seed)
                for method, seed in todo
            }
            for number, done in enumerate(concurrent.futures.as_completed(running), start=1):
                method, seed = running[done]
                record = done.result()  # a failed run stops the sweep with its log's tail
                print(
                    f"[reproduce] {number}/{len(todo)} {method} seed {seed} done in "
                    f"{record['wall_s']:.0f} s",
                    flush=True,
                )
                report()
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
