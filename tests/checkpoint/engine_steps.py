"""GSPO steps of a TrainingEngine on a fixed batch, for the export workers: the old log-probs
are the engine's own before the first step, so each step moves the trained weights."""

from __future__ import annotations

from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.sample import TrainSample


def gspo_steps(engine, batch: list[TrainSample], steps: int) -> None:
    """`steps` optimizer steps of the GSPO loss (clip 0.2) on `batch`."""
    old = engine.forward(batch).logprobs
    train = [
        TrainSample(s.prompt_ids, s.response_ids, s.advantage, old_logprobs=list(lp))
        for s, lp in zip(batch, old, strict=True)
    ]
    for _ in range(steps):
        engine.train_step(train, LossSettings("gspo", {"clip_low": 0.2, "clip_high": 0.2}))
