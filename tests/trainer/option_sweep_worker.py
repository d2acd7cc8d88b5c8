"""Sweeps option combinations through gspo-train's own code, in one process.

Each combination is composed from conf/ with Hydra, exactly as `gspo-train OVERRIDES` composes
it, and handed to `gspo_megatron.train.run_composed` (validate, build, train 2 steps, save,
close). One JSON line per combination: refused (the config error), failed (the error line), or
trained (a few metrics of each step).

    python tests/trainer/option_sweep_worker.py --sweep mismatch|sampling|all [--part I/N] --out DIR

`--part I/N` runs every N-th combination from the I-th, so that N processes can share a sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import sys
from pathlib import Path

from gspo_megatron.algorithms.losses import POLICY_LOSSES
from gspo_megatron.config import compose
from gspo_megatron.train import quiet_libraries, run_composed

SMALL = [
    "trainer.steps=2",
    "eval.every=0",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "algorithm.num_minibatches=2",
    "data.num_train=64",
    "data.num_eval=8",
    "eval.heldout.problems=4",
    "logging.progress=false",
    "logging.tensorboard=false",
]
KEYS = (
    "actor/loss",
    "actor/kl_ref",
    "actor/optimizer_steps",
    "reward/mean",
    "sampling/groups_used",
    "moe/max_expert_load_over_mean",
    "critic/loss",
)


def mismatch_sweep() -> list[list[str]]:
    """Each loss through its preset (conf/algorithm/<loss>.yaml: the paper's hyper-parameters)."""
    combos = []
    for loss in sorted(POLICY_LOSSES):
        combos.append([f"algorithm={loss}", "algorithm.mismatch=none"])
        for mode, level in itertools.product(("tis", "mis"), ("token", "sequence", "geometric")):
            combos.append(
                [f"algorithm={loss}", f"algorithm.mismatch={mode}",
                 f"algorithm.mismatch_level={level}"]
            )  # fmt: skip
    return combos


def sampling_sweep() -> list[list[str]]:
    return [
        [f"algorithm.old_logprobs={old}", f"algorithm.routing_replay={replay}",
         f"algorithm.kl_coef={kl}", f"algorithm.dynamic_sampling={sampling}"]
        for old, replay, kl, sampling in itertools.product(
            ("recompute", "rollout"), ("off", "r2", "r3"), (0.0, 0.1), ("none", "dapo", "dupo")
        )
    ]  # fmt: skip


SWEEPS = {"mismatch": mismatch_sweep, "sampling": sampling_sweep}


def run_one(overrides: list[str], run_dir: Path) -> dict:
    raw = compose(SMALL + overrides)
    # Each run starts its own one-process group on a fresh port, as a new gspo-train would.
    os.environ.pop("MASTER_ADDR", None)
    os.environ.pop("MASTER_PORT", None)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            run_composed(raw, run_dir)
    except SystemExit as exit_:
        message = exit_.code if isinstance(exit_.code, str) else err.getvalue().strip()
        status = "refused" if "config error" in str(message) else "failed"
        return {"overrides": overrides, "status": status, "message": str(message)[-2000:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{k: r[k] for k in KEYS if k in r} for r in records]
    return {"overrides": overrides, "status": "trained", "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", choices=(*SWEEPS, "all"), required=True)
    parser.add_argument("--part", default="0/1")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    part, parts = (int(x) for x in args.part.split("/"))
    quiet_libraries()
    # megatron's distributed optimizer runs gc.collect() on every save; objects alive now are
    # never garbage, so leave them out of those collections.
    gc.collect()
    gc.freeze()
    names = SWEEPS if args.sweep == "all" else (args.sweep,)
    combos = [(name, combo) for name in names for combo in SWEEPS[name]()]
    for i, (name, overrides) in enumerate(combos):
        if i % parts == part:
            result = run_one(overrides, args.out / f"run{i:03d}")
            gc.collect()
            # Native threads of the process (gloo's among them): a run must not leave its
            # process groups behind (TrainingEngine.close, parallel.destroy).
            result["threads"] = len(os.listdir("/proc/self/task"))
            print(json.dumps({"sweep": name, **result}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
