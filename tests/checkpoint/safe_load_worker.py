"""Genuine megatron checkpoints for test_safe_load.py, saved and loaded back through the safe path.

Saves a MoE model with Adam + distributed optimizer and a dense model with Adam (plain
optimizer) into --workdir; then, for each, `verify_checkpoint_safe` followed by megatron's load
(load_engine with the optimizer). Prints JSON lines {"check", "value", "ok"} and
{"timing", "verify_s", "load_s"}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from gspo_megatron.checkpoint.safe_load import load_weights_only, verify_checkpoint_safe
from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import load_preset
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

ADAM = OptimizerSettings(name="adam", lr=1e-2, weight_decay=0.01, warmup_steps=1)
CHECKPOINTS = {
    "moe_adam_distributed": ("tiny_moe", ADAM),
    "dense_adam": ("tiny_dense", dataclasses.replace(ADAM, distributed_optimizer=False)),
}


def engine(layout: ParallelLayout, preset: str, optimizer: OptimizerSettings) -> TrainingEngine:
    settings = EngineSettings(max_sequence_length=40, max_tokens_per_microbatch=64)
    return TrainingEngine(load_preset(preset), layout, settings, optimizer, decay_steps=10)


def train_one_step(engine: TrainingEngine) -> None:
    """One Adam step, so the checkpoint holds optimizer state."""
    batch = [TrainSample([1, 2, 3], [4, 5], 1.0), TrainSample([6, 7], [8, 9, 10], -1.0)]
    logprobs = engine.forward(batch).logprobs
    batch = [
        dataclasses.replace(s, old_logprobs=list(lp)) for s, lp in zip(batch, logprobs, strict=True)
    ]
    engine.train_step(batch, LossSettings("gspo"))


def report(**record) -> None:
    print(json.dumps(record), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=1234)
    for name, (preset, optimizer) in CHECKPOINTS.items():
        trained = engine(layout, preset, optimizer)
        train_one_step(trained)
        path = checkpointing.save_engine(trained, args.workdir / name)
        fresh = engine(layout, preset, optimizer)
        start = time.perf_counter()
        verify_checkpoint_safe(path)
        verify_s = time.perf_counter() - start
        start = time.perf_counter()
        checkpointing.load_engine(fresh, path, restore_rng=False)
        load_s = time.perf_counter() - start
        with open(path / "rng" / "rank_00000.pt", "rb") as f:
            load_weights_only(f, "rng")
        same = all(
            (a == b).all()
            for a, b in zip(
                trained.unwrapped_chunks[0].parameters(),
                fresh.unwrapped_chunks[0].parameters(),
                strict=True,
            )
        )
        report(check=f"{name}_loads_after_verify", value=float(same), ok=bool(same))
        report(timing=name, verify_s=verify_s, load_s=load_s)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
