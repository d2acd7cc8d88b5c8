"""The golden-number run: a seeded 5-step tiny-MoE GSPO run of gspo-train on CPU, reduced to
the per-step numbers tests/golden/test_golden.py compares (loss, reward, clip fraction, grad
norm) and a checksum of the final weights.

Regenerate the stored numbers on purpose (after a change that is meant to change them, say
why in the commit):

    python tests/golden/golden_run.py --write
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import checkpoint_tensors, gspo_train, read_metrics  # noqa: E402

GOLDEN_FILE = Path(__file__).with_name("gspo_tiny_moe_5_steps.json")
OVERRIDES = [
    "seed=7",
    "trainer.steps=5",
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]
PER_STEP = ["actor/loss", "reward/mean", "actor/clip_fraction", "actor/grad_norm"]


def weight_checksum(tensors: dict) -> dict[str, float]:
    """Sum and a position-weighted sum over every model tensor (a permutation changes the
    second), in float64."""
    total = weighted = 0.0
    for name in sorted(tensors):
        flat = tensors[name].double().flatten()
        total += float(flat.sum())
        positions = (flat.new_tensor(range(flat.numel())) % 97 + 1) / 97
        weighted += float((flat * positions).sum())
    return {"sum": total, "position_weighted_sum": weighted}


def run_golden(run_dir: Path) -> dict:
    gspo_train(run_dir, *OVERRIDES)
    records = read_metrics(run_dir)
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return {
        "command": "gspo-train " + " ".join(OVERRIDES),
        "steps": [{key: r[key] for key in PER_STEP} for r in records],
        "weights": weight_checksum(checkpoint_tensors(final)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {GOLDEN_FILE.name}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        numbers = run_golden(Path(tmp) / "run")
    text = json.dumps(numbers, indent=1)
    if args.write:
        GOLDEN_FILE.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
