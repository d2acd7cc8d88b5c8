"""LoRA gives the same log-probs, losses and adapter updates on every parallel layout as in one
process, and a fresh adapter (B = 0) is exactly the base model (docs/LORA.md).

The layouts of test_layouts.py, run by layout_worker.py with `--lora-rank 4` against a
one-process LoRA reference: log-probs (<=1e-5), losses (<=1e-6) and the weights after one SGD
step (<=1e-5; the base weights exactly unchanged, A and B both moved, saved on one process and
loaded through the checkpoint on each layout, so the adapters' checkpoint sharding is exercised
too), padded and packed; on each layout the base model (adapters off) gives the reference's base
log-probs, B = 0 gives bit-for-bit the base model's, and megatron's gradient buffers and
optimizer hold every adapter parameter and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import layouts_by_launch, run_worker
from layout_text import VERIFIED_LAYOUTS as LAYOUTS

WORKERS = Path(__file__).resolve().parent
LOSSES = ("gspo", "gspo_token")  # a sequence-level and a token-level loss


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_reference")
    run_worker(WORKERS / "layout_worker.py", ["--make-reference", str(out), "--lora-rank", "4"])
    return out


@pytest.fixture(scope="module")
def lora_checks(lora_reference):
    args = ["--ref-dir", str(lora_reference), "--lora-rank", "4", "--losses", ",".join(LOSSES)]
    return layouts_by_launch(WORKERS / "layout_worker.py", LAYOUTS, args)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "nproc"), [pytest.param(text, n, id=name) for text, n, name in LAYOUTS]
)
def test_lora_layout_matches_single_process(lora_checks, layout, nproc):
    results = lora_checks(layout, nproc)
    checks = {r["check"]: r for r in results}
    for name in (
        "base_logprobs_max_abs_diff",
        "fresh_adapter_vs_base_max_abs_diff",
        "optimizer_params_not_adapters",
        "optimizer_adapters_missing",
        "grad_buffers_params_not_adapters",
        "grad_buffers_adapters_missing",
        "trainable_params_beyond_adapters",
    ):
        assert f"lora/{name}" in checks
    for mode in ("padded", "packed"):
        assert f"{mode}/logprobs_max_abs_diff" in checks
        for loss in LOSSES:
            for kind in ("loss_abs_diff", "params_rel_diff", "update_rel_diff", "base_max_update"):
                assert f"{mode}/{loss}_{kind}" in checks
            # Both factors train (the reference's B starts nonzero).
            assert checks[f"{mode}/{loss}_lora_a_max_update"]["value"] > 1e-4
            assert checks[f"{mode}/{loss}_lora_b_max_update"]["value"] > 1e-4
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
