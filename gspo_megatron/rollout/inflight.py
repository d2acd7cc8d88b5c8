"""The rollouts in flight at a checkpoint (rollout.mode one_step_off / async), as a file.

A checkpoint of a run with batches generated ahead records, besides the sampler before the
oldest of them, every batch still in flight: its step, its sampling settings and, per sample,
the progress the rollout engine reported (`JobProgress`: complete samples, and partial ones with
their tokens so far, each token's log-prob and weight version, the finish state, routes of the
complete ones for R3). Rank 0 writes it as `rollout_inflight.pt` in the checkpoint (tensors and
plain values only, in the manifest with the other files); a resumed run loads it with
`weights_only=True` (`safe_load.load_weights_only`), so reading it never runs code.

The per-sample streams the samples were drawn from are the engine's: seeded by the batch's
sampling seed and the sample's place in the batch (the embedded engine's uniforms, SGLang's
`sampling_seed`), so continuing a partial sample needs nothing but its tokens and the batch's
settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gspo_megatron.rollout.base import JobProgress, RolloutSample, SamplingParams

INFLIGHT_FILE = "rollout_inflight.pt"
FORMAT = 1


class InFlightError(ValueError):
    """A record of rollouts in flight that cannot be used; the message names what."""


@dataclass
class InFlightBatch:
    """One batch generated ahead: it trains step `step` + 1."""

    step: int
    params: SamplingParams
    progress: JobProgress


def summary(batches: list[InFlightBatch]) -> dict[str, Any]:
    """What gspo_checkpoint.json says about them (every rank reads it; the file is rank 0's)."""
    samples = [s for b in batches for g in b.progress.samples for s in g]
    done = sum(f for b in batches for row in b.progress.done for f in row)
    return {
        "format": FORMAT,
        "file": INFLIGHT_FILE,
        "steps": [b.step for b in batches],
        "samples": len(samples),
        "complete_samples": done,
        "tokens": sum(len(s.response_ids) for s in samples),
    }


def to_payload(batches: list[InFlightBatch]) -> dict[str, Any]:
    """The file's content: plain values and tensors (what `torch.load(weights_only=True)` reads)."""
    return {
        "format": FORMAT,
        "batches": [
            {
                "step": b.step,
                "params": {
                    **dataclasses.asdict(b.params),
                    "stop_token_ids": list(b.params.stop_token_ids),
                },
                "samples": [
                    [_sample_record(s, done) for s, done in zip(g, flags, strict=True)]
                    for g, flags in zip(b.progress.samples, b.progress.done, strict=True)
                ],
            }
            for b in batches
        ],
    }


def from_payload(payload: Any, source: str) -> list[InFlightBatch]:
    """The batches of a file's content; InFlightError naming `source` when it is malformed."""
    try:
        if payload["format"] != FORMAT:
            raise InFlightError(f"{source}: format {payload['format']!r}, expected {FORMAT}")
        out = []
        for b in payload["batches"]:
            params = dict(b["params"])
            params["stop_token_ids"] = tuple(params["stop_token_ids"])
            groups = [[_sample(r) for r in g] for g in b["samples"]]
            done = [[bool(r["done"]) for r in g] for g in b["samples"]]
            out.append(
                InFlightBatch(int(b["step"]), SamplingParams(**params), JobProgress(groups, done))
            )
        return out
    except InFlightError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise InFlightError(f"{source}: malformed record of rollouts in flight ({err!r})") from err


def _sample_record(sample: RolloutSample, done: bool) -> dict[str, Any]:
    routes = sample.routed_experts if done else None  # a continuation records them anew
    return {
        "done": bool(done),
        "prompt": torch.tensor(sample.prompt_ids, dtype=torch.int32),
        "response": torch.tensor(sample.response_ids, dtype=torch.int32),
        "logprobs": torch.tensor(sample.logprobs, dtype=torch.float64),  # exactly as given
        "versions": torch.tensor(sample.versions(), dtype=torch.int32),
        "finish": sample.finish_reason,
        "version": int(sample.weight_version),
        "routes": None if routes is None else torch.from_numpy(_smallest_int(routes)),
    }


def _sample(record: dict[str, Any]) -> RolloutSample:
    response = record["response"].tolist()
    logprobs = record["logprobs"].tolist()
    versions = record["versions"].tolist()
    if not len(response) == len(logprobs) == len(versions):
        raise ValueError(
            f"{len(response)} tokens, {len(logprobs)} log-probs and {len(versions)} versions"
        )
    routes = record["routes"]
    finish = record["finish"]
    if finish not in ("stop", "length", "abort"):
        raise ValueError(f"finish reason {finish!r}")
    version = int(record["version"])
    return RolloutSample(
        prompt_ids=record["prompt"].tolist(),
        response_ids=response,
        logprobs=logprobs,
        finish_reason=finish,
        weight_version=version,
        routed_experts=None if routes is None else routes.numpy().astype(np.int32),
        token_versions=None if all(v == version for v in versions) else versions,
    )


def _smallest_int(routes: np.ndarray) -> np.ndarray:
    """Expert ids in the narrowest integer type that holds them (uint8 for up to 256 experts)."""
    top = int(routes.max(initial=0))
    for dtype in (np.uint8, np.int16):
        if top <= np.iinfo(dtype).max:
            return routes.astype(dtype)
    return routes.astype(np.int32)
