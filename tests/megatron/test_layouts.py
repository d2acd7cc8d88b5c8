"""The engine gives the same log-probs, losses and updates on every parallel layout, padded and
packed.

Each case launches real processes over gloo, loads the one-process reference's weights, cuts the
batch into several micro-batches per rank (the reference uses one padded micro-batch), padded and
then packed (THD), and checks per-token log-probs (<=1e-5), the loss of gspo, grpo, gspo_token
and dapo (<=1e-6) and the weights after one SGD step (<=1e-5 relative to the weights and to the
update itself); and packed against padded on the same layout: log-probs and losses <=1e-6, weights
<=1e-6 relative. Routing replay: routes recorded padded (standing for a rollout engine's, R3) equal
those recorded packed (R2), and replaying them, padded or packed, makes every router's own choice
equal the replayed experts at every token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import layouts_by_launch
from layout_text import VERIFIED_LAYOUTS

WORKERS = Path(__file__).resolve().parent

LAYOUTS = VERIFIED_LAYOUTS


@pytest.fixture(scope="module")
def layout_checks(layout_reference):
    return layouts_by_launch(
        WORKERS / "layout_worker.py", LAYOUTS, ["--ref-dir", str(layout_reference)]
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "nproc"), [pytest.param(text, n, id=name) for text, n, name in LAYOUTS]
)
def test_layout_matches_single_process(layout_checks, layout, nproc):
    results = layout_checks(layout, nproc)
    checks = {r["check"]: r for r in results}
    for mode in ("padded", "packed", "packed_vs_padded"):
        assert f"{mode}/logprobs_max_abs_diff" in checks
        for name in ("gspo", "grpo", "gspo_token", "dapo"):
            for kind in ("loss_abs_diff", "params_rel_diff", "update_rel_diff"):
                assert f"{mode}/{name}_{kind}" in checks
    for mode in ("padded", "packed"):
        for kind in ("recorded_routes_mismatch", "replayed_routes_differ_from_router_choice"):
            assert f"{mode}/{kind}" in checks
        for name in ("gspo", "grpo", "gspo_token", "dapo"):
            # Several micro-batches per rank, against the reference's single one.
            assert checks[f"{mode}/{name}_min_microbatches_per_rank"]["value"] >= 2
    # Packing computes no padding beyond what CP and SP need (at most 2*cp-1 tokens a sequence).
    assert (
        checks["packed/gspo_padding_fraction"]["value"]
        < checks["padded/gspo_padding_fraction"]["value"]
    )
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
