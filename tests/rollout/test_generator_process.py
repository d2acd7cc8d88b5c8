"""The generator process of rollout.mode one_step_off / async (tests/rollout/generator_worker.py):

- its samples equal the in-process embedded engine's (the same seeded tokens), and their
  log-probs the trainer's recompute within 1e-6 (float32);
- a partial rollout: weights published between two tokens reach the rows in flight, each
  response spans both versions in order, and every token's log-prob equals the recompute with
  its own version's weights within 1e-6;
- a job waits for weights as new as its `min_version` (the staleness bound), an urgent job
  (evaluation) overtakes a waiting one, and a killed process fails the pending jobs with one
  clear error.
"""

from __future__ import annotations

from pathlib import Path

from launch import run_worker

WORKER = Path(__file__).resolve().parent / "generator_worker.py"

CHECKS = [
    "process_tokens_equal_embedded",
    "process_logprob_vs_trainer",
    "process_token_versions",
    "partial_responses_span_two_versions",
    "rows_finished_before_the_swap",
    "partial_versions_in_order",
    "partial_logprob_vs_trainer_per_version",
    "partial_both_versions_checked",
    "urgent_job_overtakes_gated_one",
    "gated_job_waited_for_its_version",
    "dead_process_fails_pending_jobs",
]


def test_generator_process_against_the_trainer():
    lines = run_worker(WORKER, [], timeout=600)
    results = {r["check"]: r for r in lines if "check" in r}
    assert sorted(results) == sorted(CHECKS), sorted(results)
    failed = [r for r in results.values() if not r["ok"]]
    assert not failed, failed
