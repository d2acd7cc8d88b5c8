"""The embedded rollout engine on megatron, one process and 2-process layouts (real gloo groups).

Each case launches tests/rollout/embedded_worker.py, which checks against no-cache references:
greedy generation equals a step-by-step argmax loop over the full sequence (tokens exactly,
log-probs <= 1e-5); sampled log-probs equal TrainingEngine.forward's recomputed ones (<= 1e-5,
fp32); with temperature/top-k/top-p the log-probs are those of the renormalised processed
distribution; stop tokens and max_new_tokens (and the trainer's max sequence length) are
honoured; a seed fixes the samples whatever the batching; recorded routes equal the trainer's;
multi-turn episodes (scripted observations between turns) keep the model tokens' log-probs
equal to the trainer's recompute (<= 1e-6) and their routes cover the whole trajectory, and
with context kept between turns (rollout.prefix_cache_tokens) give the same tokens and routes
with log-probs within 1e-5, the torch decoder reusing K/V and the megatron one counting every
prompt it prefilled whole; after a
train step + update_weights the samples come from the new weights; train mode and
sequence parallelism are restored; every rank returns the same samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_worker

WORKER = Path(__file__).resolve().parent / "embedded_worker.py"

CORE = [
    "greedy_equals_nocache_argmax",
    "greedy_logprob_vs_nocache",
    "sampled_logprob_vs_trainer",
    "processed_logprob_vs_reference",
    "stop_tokens_and_max_new_tokens",
    "max_sequence_length_cap",
    "same_seed_same_samples",
    "independent_of_batching",
    "unseeded_calls_reproducible",
    "routed_experts_equal_trainer_routes",
    "episode_logprob_vs_trainer",
    "episode_routes_cover_trajectory",
    "kept_context_same_tokens_and_routes",
    "kept_context_logprob_vs_plain",
    "kept_context_counted_and_dropped_by_update",
    "kept_context_held",
    "train_mode_and_sequence_parallel_restored",
    "after_update_equals_new_model_reference",
    "after_update_sampled_logprob_vs_trainer",
    "greedy_identical_on_all_ranks",
    "sampled_identical_on_all_ranks",
    "uneven_shares_logprob_vs_trainer",
]


def run(cases: list[tuple[str, str]], nproc: int) -> dict[str, tuple[dict, dict]]:
    """Each (layout, backends) case, one after another in one launch (process start-up is much
    of a case's time): its checks and sample digests, by layout."""
    args = [
        arg for layout, backends in cases for arg in ("--layout", layout, "--backends", backends)
    ]
    lines = run_worker(WORKER, args, nproc=nproc, timeout=900)
    out = {}
    for layout, _ in cases:
        mine = [r for r in lines if r["layout"] == layout]
        results = {r["check"]: r for r in mine if "check" in r}
        out[layout] = results, {r["digest"]: r["value"] for r in mine if "digest" in r}
    return out


def expect(results: dict, backend: str, names: list[str]) -> None:
    """Every check of `names` ran for `backend`, and every check passed."""
    missing = [n for n in names if f"{backend}_{n}" not in results]
    assert not missing, missing
    failed = [r for r in results.values() if not r["ok"]]
    assert not failed, failed


def test_single_process_both_backends():
    """The lean torch decoder (default on one rank) and megatron's GPTModel path."""
    results, digests = run([("", "torch,megatron")], 1)[""]
    expect(results, "torch", CORE + ["interface"])
    expect(results, "megatron", CORE + ["interface"])
    # same weights (same seed): the same seeded samples from both decoders
    assert digests["torch_sampled"] == digests["megatron_sampled"]
    assert digests["torch_greedy"] == digests["megatron_greedy"]


TWO_PROCESS_CASES = [
    # layout, backends, the backends expected to run, checks beyond CORE, id
    ("tp=2,sp=1", "megatron", ["megatron"], [], "tp2-sp"),
    ("", "torch,megatron", ["torch", "megatron"], [], "dp2"),
    ("ep=2", "megatron", ["megatron"], ["lockstep_idle_forwards"], "ep2-dp2-lockstep"),
    ("tp=2,sp=1,ep=2", "torch,megatron", ["megatron"], [], "tp2-sp-ep2"),
]


@pytest.fixture(scope="module")
def two_process_results() -> dict[str, tuple[dict, dict]]:
    return run([(layout, backends) for layout, backends, *_ in TWO_PROCESS_CASES], 2)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "backends", "expected", "extra"),
    [pytest.param(*case[:4], id=case[4]) for case in TWO_PROCESS_CASES],
)
def test_two_process_layouts(two_process_results, layout, backends, expected, extra):
    results, _ = two_process_results[layout]
    for backend in expected:
        expect(results, backend, CORE + extra)
    if "torch" in backends and "torch" not in expected:
        # the lean decoder refuses split models with a clear message
        assert "torch_unavailable" in results
