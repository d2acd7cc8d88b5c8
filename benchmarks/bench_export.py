"""What the Hugging Face export after a checkpoint costs, against the steps of the same run.

    python benchmarks/bench_export.py [--steps 8] [--every 2] [OVERRIDE ...]

Runs `gspo-train` (the default configuration, plus OVERRIDEs) with trainer.export_hf_every and
reads, side by side from that one run, each step's time (`time/step` in metrics.jsonl) and
each export's own record (`checkpoints/step_N/hf/gspo_export.json`: the seconds it spent
writing the shards, config and tokenizer; reading them back against the live shards; and the
probe: the trainer's forward and transformers' on the probe batch). Prints the medians and the
export's cost as a fraction of one step and, amortised, of the `every` steps it covers.

A bigger model than the default one, e.g.:
    python benchmarks/bench_export.py model.hidden_size=256 model.moe_intermediate_size=256 \
        model.num_hidden_layers=4 model.vocab_size=1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run = Path(scratch) / "run"
        cmd = [
            sys.executable, "-m", "gspo_megatron.train", f"hydra.run.dir={run}",
            f"trainer.steps={args.steps}", f"trainer.export_hf_every={args.every}",
            "trainer.save_every=0", "trainer.save_every_minutes=0", "eval.every=0",
            "logging.progress=false", "logging.tensorboard=false",
            f"trainer.keep_last={args.steps}", *args.overrides,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        exports = [
            json.loads(p.read_text())
            for p in sorted((run / "checkpoints").glob("step_*/hf/gspo_export.json"))
        ]
    step_s = statistics.median(r["time/step"] for r in steps)
    parts = {k: statistics.median(e["seconds"][k] for e in exports) for k in exports[0]["seconds"]}
    total = sum(parts.values())
    print(f"model: {exports[0]['bytes'] / 2**20:.1f} MiB exported ({exports[0]['dtype']}), "
          f"{len(exports)} exports over {len(steps)} steps")  # fmt: skip
    print(f"step (median time/step)        {step_s:8.3f} s")
    for key, value in parts.items():
        print(f"export {key:<23} {value:8.3f} s   {value / step_s:6.2f} x a step")
    print(f"export, all                    {total:8.3f} s   {total / step_s:6.2f} x a step")
    verify = parts.get("compare_s", 0.0) + parts.get("probe_s", 0.0)
    print(f"verification (compare + probe) {verify:8.3f} s   {verify / step_s:6.2f} x a step")
    print(f"amortised over export_hf_every={args.every} steps: {total / (args.every * step_s):.3f}"
          " of the steps' time")  # fmt: skip
    worst = max(e["logprob_diff"]["max"] for e in exports)
    print(f"log-prob difference vs transformers, worst export: {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
