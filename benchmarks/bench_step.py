"""Time per RL step split by phase, on the default configuration (CPU, one process).

    python benchmarks/bench_step.py [--steps 40] [--warmup 5] [extra Hydra overrides ...]

Runs `gspo-train` for --steps steps in a temporary directory (no evaluation, no progress bar)
and prints the mean seconds of each phase over the steps after the warm-up, with each phase's
share of the step, all from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ["time/generate", "time/old_logprobs", "time/train", "time/sync_weights"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "gspo_megatron.train",
            f"hydra.run.dir={tmp}",
            f"trainer.steps={args.steps}",
            "eval.every=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            *overrides,
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        records = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    measured = records[args.warmup :]
    step = sum(r["time/step"] for r in measured) / len(measured)
    print(f"{len(measured)} steps after {args.warmup} warm-up steps; overrides: {overrides}")
    print(f"{'phase':<22}{'seconds':>10}{'share':>8}")
    for phase in PHASES:
        mean = sum(r[phase] for r in measured) / len(measured)
        print(f"{phase:<22}{mean:>10.4f}{mean / step:>8.1%}")
    other = step - sum(sum(r[p] for r in measured) / len(measured) for p in PHASES)
    print(f"{'(scoring, logging)':<22}{other:>10.4f}{other / step:>8.1%}")
    print(f"{'time/step':<22}{step:>10.4f}{1:>8.0%}")
    tokens = sum(r["perf/rollout_tokens_per_s"] for r in measured) / len(measured)
    print(
        f"rollout tokens/s {tokens:.0f}; "
        f"train tokens/s {sum(r['perf/train_tokens_per_s'] for r in measured) / len(measured):.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
