"""The record of the rollouts in flight a checkpoint holds (rollout/inflight.py): every field of
complete and partial samples back as it was written, read with weights_only (a crafted file's
code never runs), malformed records named, and its size."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

from gspo_megatron.checkpoint.safe_load import UnsafeCheckpointError, load_weights_only
from gspo_megatron.rollout.base import JobProgress, RolloutSample, SamplingParams
from gspo_megatron.rollout.inflight import (
    INFLIGHT_FILE,
    InFlightBatch,
    InFlightError,
    from_payload,
    summary,
    to_payload,
)

PARAMS = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6, stop_token_ids=(2,), seed=11)


def batches() -> list[InFlightBatch]:
    routes = np.arange(5 * 2 * 3, dtype=np.int32).reshape(5, 2, 3) % 7
    complete = RolloutSample([1, 4, 5], [7, 8, 2], [-0.1, -0.25, -1e-9], "stop", 3, routes)
    spans = RolloutSample([1, 4, 5], [9, 3], [-0.5, -2.0], "abort", 4, token_versions=[3, 4])
    behind = RolloutSample([1, 6], [3], [-0.75], "abort", 4, token_versions=[3])  # one behind
    empty = RolloutSample([1, 6], [], [], "abort", 4, token_versions=[])
    progress = JobProgress([[complete, spans], [behind, empty]], [[True, False], [False, False]])
    return [InFlightBatch(3, PARAMS, progress)]


def roundtrip(payload) -> object:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    buffer.seek(0)
    return load_weights_only(buffer, INFLIGHT_FILE)


def test_every_field_comes_back():
    before = batches()
    (after,) = from_payload(roundtrip(to_payload(before)), INFLIGHT_FILE)
    assert after.step == 3 and after.params == PARAMS
    assert after.progress.done == before[0].progress.done
    for a, b in zip(
        [s for g in after.progress.samples for s in g],
        [s for g in before[0].progress.samples for s in g],
        strict=True,
    ):
        assert (a.prompt_ids, a.response_ids, a.logprobs, a.finish_reason, a.weight_version) == (
            b.prompt_ids, b.response_ids, b.logprobs, b.finish_reason, b.weight_version
        )  # fmt: skip
        assert a.versions() == b.versions()  # each token's own version, a lagging one too
    routes = after.progress.samples[0][0].routed_experts
    assert routes.dtype == np.int32 and np.array_equal(routes, before[0].progress.samples[0][0]
                                                       .routed_experts)  # fmt: skip
    assert after.progress.samples[0][1].routed_experts is None  # partial: recorded anew
    assert summary(before) == {
        "format": 1, "file": INFLIGHT_FILE, "steps": [3], "samples": 4, "complete_samples": 1,
        "tokens": 6,
    }  # fmt: skip


def test_routes_are_stored_narrow():
    record = to_payload(batches())["batches"][0]["samples"][0][0]
    assert record["routes"].dtype == torch.uint8  # expert ids < 256


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: p.update(format=7), "format 7, expected 1"),
        (lambda p: p["batches"][0]["samples"][0][0].pop("versions"), "'versions'"),
        (lambda p: p["batches"][0]["samples"][0][0].update(finish="done"), "finish reason"),
        (
            lambda p: p["batches"][0]["samples"][0][1].update(logprobs=torch.zeros(5)),
            "2 tokens, 5 log-probs and 2 versions",
        ),
    ],
    ids=["format", "missing-field", "finish-reason", "lengths"],
)
def test_a_malformed_record_is_named(damage, said):
    payload = to_payload(batches())
    damage(payload)
    with pytest.raises(InFlightError) as err:
        from_payload(roundtrip(payload), INFLIGHT_FILE)
    assert INFLIGHT_FILE in str(err.value) and said in str(err.value)


class _Crafted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_record_runs_no_code(tmp_path):
    path, marker = tmp_path / INFLIGHT_FILE, tmp_path / "ran"
    payload = to_payload(batches())
    payload["batches"][0]["step"] = _Crafted(marker)
    torch.save(payload, path)  # as a checkpoint holds it, with code where a step should be
    with open(path, "rb") as f, pytest.raises(UnsafeCheckpointError) as err:
        load_weights_only(f, str(path))
    assert "system" in str(err.value) and not marker.exists()
