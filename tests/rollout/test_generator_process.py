"""The generator process of rollout.mode one_step_off / async (tests/rollout/generator_worker.py):

- its samples equal the in-process embedded engine's (the same seeded tokens), and their
  log-probs the trainer's recompute within 1e-6 (float32);
- a partial rollout: weights published between two tokens reach the rows in flight, each
  response spans both versions in order, and every token's log-prob equals the recompute with
  its own version's weights within 1e-6;
- a job waits for weights as new as its `min_version` (the staleness bound), an urgent job
  (evaluation) and a later job whose weights are there (another batch's episode turns)
  overtake a waiting one (and, without a process, the order the process picks its queued jobs
  in), and a killed process fails the pending jobs with one clear error;
- a partial response continued from its first tokens (a checkpoint's) has the uninterrupted
  one's tokens, log-probs within 1e-6 of them and of the trainer's recompute, and samples only
  what it lacked;
- async: a snapshot between two tokens records every row's tokens, the job goes on from it, and
  a new job given the same record (a resumed run's) returns the same samples bit for bit;
- pinned (one_step_off): a weight update waits for the jobs pinned to the version before, which
  keep their version; jobs another thread submits while updates run keep theirs too (none
  pinned to weights being overwritten); a snapshot lets the running job finish;
- a LoRA policy: the process merges the synced adapters, its log-probs equal the trainer's
  recompute with the adapters within 1e-5 over two versions (and differ from the base model's
  by far more), and the base weights crossed with the first update only; a whole weight
  trained beside the adapters (the output layer) crosses with every update.
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
    "ready_job_overtakes_gated_one",
    "gated_job_waited_for_its_version",
    "dead_process_fails_pending_jobs",
    "partial_rows_hold_their_tokens",
    "continued_tokens_equal_uninterrupted",
    "continued_logprobs_vs_uninterrupted",
    "continued_prefix_logprobs_kept",
    "continued_rows_sample_only_the_rest",
    "continued_logprob_vs_trainer",
    "snapshot_holds_partial_rows",
    "job_goes_on_from_the_snapshot",
    "job_samples_each_token_once",
    "resumed_job_equals_the_uninterrupted",
    "resumed_job_samples_only_the_rest",
    "update_waits_for_the_pinned_job",
    "pinned_job_keeps_its_version",
    "pinned_snapshot_waits_for_the_job",
    "pinned_jobs_submitted_during_updates",
    "lora_process_logprob_vs_trainer_v0",
    "lora_adapters_change_logprobs_v0",
    "lora_process_logprob_vs_trainer_v1",
    "lora_adapters_change_logprobs_v1",
    "lora_base_sent_once",
    "lora_trained_weights_synced",
]


def test_generator_process_against_the_trainer():
    lines = run_worker(WORKER, [], timeout=600)
    results = {r["check"]: r for r in lines if "check" in r}
    assert sorted(results) == sorted(CHECKS), sorted(results)
    failed = [r for r in results.values() if not r["ok"]]
    assert not failed, failed


def test_the_next_job_is_the_first_whose_weights_are_there():
    """The process's choice among its queued jobs (`_next_job`): one waiting for newer weights
    (min_version, or a pinned version) is passed over; among the rest, urgent ones first, then
    the oldest batch's (lowest min_version), then submission order."""
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.embedded.generator import _Job, _next_job

    def job(job_id, min_version, urgent=False, pinned=None):
        return _Job(job_id, [[1]], 1, SamplingParams(), min_version, urgent, pinned)

    gated, later_batch, older_batch = job(0, 2), job(1, 1), job(2, 0)
    assert _next_job([gated, later_batch, older_batch], published=1) is older_batch
    assert _next_job([gated, later_batch], published=1) is later_batch
    assert _next_job([gated], published=1) is None
    assert _next_job([gated, later_batch, job(3, 1, urgent=True)], published=1).job_id == 3
    assert _next_job([job(4, 0, pinned=2), job(5, 1, pinned=1)], published=1).job_id == 5
    assert _next_job([job(6, 1), job(7, 1)], published=2).job_id == 6
