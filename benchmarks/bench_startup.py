"""How long gspo-train takes to start: --help, a config error, and the default run's first RL
step, as wall and CPU time of fresh processes, medians of --repeats.

    python benchmarks/bench_startup.py [--repeats 5] [--baseline /path/to/other/checkout]

Each measurement starts `python -m gspo_megatron.train ...` as a new process (as the console
script does), with this checkout on PYTHONPATH:

1. `--help`: the config groups and the composed config (config.help_text).
2. A config error (optimizer.lr=-1): the one-line message, which comes before megatron-core
   and transformers are imported (torch is: the loss registry the checks consult needs it).
3. The first RL step of the default run (no evaluation, no progress bar, no TensorBoard):
   from the start of the process until metrics.jsonl holds the first step's record; the process
   is then stopped. Its CPU time is the process's until then.

With --baseline, the same commands run against that checkout too, alternated with this one, and
the table gives both and their ratio (another checkout: `git worktree add /tmp/base <commit>`,
or without a worktree `mkdir /tmp/base && git archive <commit> | tar -x -C /tmp/base`).
The import breakdown of one command: `python -X importtime -m gspo_megatron.train --help`.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUIET = ["logging.progress=false", "logging.tensorboard=false", "eval.every=0"]


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_to_exit(repo: Path, args: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s, stderr) of a process that runs to its end."""
    env = dict(os.environ, PYTHONPATH=str(repo))
    cpu, wall = _child_cpu(), time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_megatron.train", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
    )
    return time.perf_counter() - wall, _child_cpu() - cpu, proc.stderr


def run_to_first_step(repo: Path, timeout_s: float = 600.0) -> tuple[float, float]:
    """(wall s, CPU s) from the start of a default run until its first step is recorded."""
    env = dict(os.environ, PYTHONPATH=str(repo))
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        wall = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gspo_megatron.train", f"hydra.run.dir={tmp}", *QUIET],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd=repo,
        )
        while not (metrics.exists() and metrics.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"gspo-train exited: {proc.stderr.read().decode()[-2000:]}")
            if time.perf_counter() - wall > timeout_s:
                proc.kill()
                raise RuntimeError("no first step within the timeout")
            time.sleep(0.02)
        elapsed = time.perf_counter() - wall
        proc.send_signal(signal.SIGKILL)
        _, _, usage = os.wait4(proc.pid, 0)
        proc.stderr.close()
        return elapsed, usage.ru_utime + usage.ru_stime


def measure(repo: Path) -> dict[str, tuple[float, float]]:
    help_wall, help_cpu, _ = run_to_exit(repo, ["--help"])
    error_wall, error_cpu, stderr = run_to_exit(repo, ["optimizer.lr=-1"])
    if "config error" not in stderr:
        raise RuntimeError(f"expected a config error, got: {stderr[-2000:]}")
    return {
        "gspo-train --help": (help_wall, help_cpu),
        "config error (optimizer.lr=-1)": (error_wall, error_cpu),
        "default run: to the first RL step": run_to_first_step(repo),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    args = parser.parse_args()
    checkouts = {"this": REPO}
    if args.baseline is not None:
        checkouts = {"baseline": args.baseline.resolve(), "this": REPO}
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.repeats):  # alternated, so that load changes hit both
        for name, repo in checkouts.items():
            runs[name].append(measure(repo))
    load = os.getloadavg()[0]
    print(
        f"medians of {args.repeats} fresh processes each (load average {load:.1f} on "
        f"{os.cpu_count()} CPUs)"
    )
    header = f"{'':<36}" + "".join(f"{name + ' wall s':>16}{name + ' CPU s':>15}" for name in runs)
    if args.baseline is not None:
        header += f"{'wall ratio':>12}{'CPU ratio':>11}"
    print(header)
    for what in runs["this"][0]:
        medians = {
            name: [statistics.median(r[what][i] for r in results) for i in (0, 1)]
            for name, results in runs.items()
        }
        line = f"{what:<36}" + "".join(f"{w:>16.2f}{c:>15.2f}" for w, c in medians.values())
        if args.baseline is not None:
            base, this = medians["baseline"], medians["this"]
            line += f"{base[0] / this[0]:>11.2f}x{base[1] / this[1]:>10.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
