"""Rollouts in flight across kill -9, and the Hugging Face export's (docs/ROLLOUT.md,
"Checkpoints"; docs/CHECKPOINTS.md, "Hugging Face export").

- Embedded engine, async (pinned versions) and one_step_off: one run killed at five points —
  during generation (the generator process mid-batch: each job takes longer than a step), in a
  weight swap (the generator's staging copy half written), in a save (no manifest), right after
  a checkpoint's rename (its export not written yet), and in an export — and resumed each time,
  ends with the records, weights and exports of an uninterrupted run, bit for bit, and no token
  that a checkpoint held was sampled again; exports go with their checkpoints' rotation.
- Embedded engine, async (new weights between tokens): a checkpoint holds partial rollouts; the
  resumed run continues them (their recorded tokens are kept, only the rest is sampled) and
  records every step once within the staleness bound.
- SGLang (the stand-in), async: the same, with every prompt drawn exactly once (the sampler of
  the last checkpoint equals an uninterrupted run's) and partial rollouts continued from their
  recorded tokens (the servers' request log).

Faults and the generator's pace come from tests/faults/inject. Runs are small; each start of
gspo-train costs seconds, so these are marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO, gspo_train, gspo_train_command, gspo_train_env, read_metrics

from gspo_megatron.checkpoint import manifest

pytestmark = pytest.mark.slow

TINY = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]
# What depends on timing or on where a run was resumed (tokens restored from a checkpoint are
# not sampled again: the counts differ, their sum is checked).
MOVING = (
    "time/",
    "perf/",
    "async/queue_ready",
    "async/restored_tokens",
    "async/sampled_tokens",
)
PACE = "generator_token_delay_ms=25"  # 12 tokens: 0.3 s a batch, longer than a step trains


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


def stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MOVING)} for r in records]


def regenerated(records: list[dict]) -> float:
    """Tokens sampled again although a checkpoint held them: for every step, what the engine
    sampled plus what came from a checkpoint, less the batch's tokens."""
    return sum(
        r["async/sampled_tokens"] + r["async/restored_tokens"] - r["response/tokens"]
        for r in records
    )


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from launch import checkpoint_tensors

    return checkpoint_tensors(checkpoint)


def export_digests(checkpoint: Path) -> dict[str, str]:
    """The export's shards and index, as its manifest lists them."""
    listed = manifest.read_manifest(checkpoint)
    return {
        k: v["sha256"]
        for k, v in listed.items()
        if k.startswith("hf/") and (k.endswith(".safetensors") or k.endswith(".index.json"))
    }


def start_reference(run: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    """The uninterrupted run, beside the killed ones (one thread each, two cores)."""
    return subprocess.Popen(
        gspo_train_command(run, overrides), env=gspo_train_env(faults=PACE), cwd=REPO,
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip


KILLS = [
    # attempt 1, fresh: step 3's second optimizer step, the generator mid-batch
    "kill_after_optimizer_step=10",
    # resumed at 2: the weight update after step 3 (the resume's own update is the first)
    "kill_mid_weight_update=2",
    # resumed at 2: step 4's save has its data, no manifest
    "kill_before_manifest=1",
    # resumed at 2: step_4 renamed into place, its export not begun
    "kill_after_publish=1",
    # resumed at 4 (its export is done first, the 1st); step 6's export, shards written
    "kill_mid_hf_export=2",
]


@pytest.mark.parametrize(
    "mode",
    [
        ["rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2",
         "rollout.pin_versions=true"],
        ["rollout.mode=one_step_off"],
    ],
    ids=["async-pinned", "one-step-off"],
)  # fmt: skip
def test_kill_9_at_five_points_then_resume_equals_an_uninterrupted_run(tmp_path, mode):
    common = [
        *TINY, *mode, "rollout.max_new_tokens=12", "trainer.steps=6", "trainer.save_every=2",
        "trainer.export_hf_every=2", "seed=5",
    ]  # fmt: skip
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    reference = start_reference(straight, common, tmp_path / "straight.log")
    for fault in KILLS:
        gspo_train(killed, *common, faults=f"{fault},{PACE}", expect="killed")
    final = gspo_train(killed, *common, faults=PACE)
    assert reference.wait(timeout=900) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    records, expected = read_metrics(killed), read_metrics(straight)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert stable(records) == stable(expected)
    assert regenerated(records) == 0
    assert sum(r["async/restored_tokens"] for r in records) > 0  # the checkpoints held work
    a, b = weights(step_dir(straight, 6)), weights(step_dir(killed, 6))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # step 2's checkpoint went with the rotation (trainer.keep_last=2), its export with it
    assert not step_dir(killed, 2).exists() and not step_dir(straight, 2).exists()
    for step in (4, 6):
        exported = export_digests(step_dir(killed, step))
        assert exported and exported == export_digests(step_dir(straight, step)), step
        record = json.loads((step_dir(killed, step) / "hf" / "gspo_export.json").read_text())
        assert record["verified"], record
        assert not list(step_dir(killed, step).glob("hf.tmp-*"))
    assert "Hugging Face export verified" in final.stderr  # step 6's, redone at the resume


def test_async_resume_continues_partial_rollouts(tmp_path):
    """New weights between tokens (not pinned): the checkpoint of step 2 holds partial rollouts
    (the generator is mid-batch when the trainer saves); the run is killed right after it, and
    the resumed run keeps their tokens and samples only the rest."""
    run = tmp_path / "run"
    common = [
        *TINY, "rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2",
        "rollout.max_new_tokens=24", "trainer.steps=4", "trainer.save_every=2", "seed=3",
    ]  # fmt: skip
    gspo_train(run, *common, faults=f"kill_after_publish=1,{PACE}", expect="killed")
    held = json.loads((step_dir(run, 2) / "gspo_checkpoint.json").read_text())["extra"]
    in_flight = held["in_flight"]
    assert in_flight["steps"] == [2, 3]
    assert in_flight["tokens"] > 0 and in_flight["complete_samples"] < in_flight["samples"]
    proc = gspo_train(run, *common, faults=PACE)
    assert "continuing 2 batches in flight at the checkpoint" in proc.stderr
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert regenerated(records) == 0
    restored = records[2]["async/restored_tokens"] + records[3]["async/restored_tokens"]
    assert restored == in_flight["tokens"]
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in records)


def _sglang_stand_in():
    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    import sglang_test_server

    return sglang_test_server


def test_sglang_async_resume_draws_every_prompt_once_and_continues_partial_rollouts(tmp_path):
    """async on the SGLang stand-in (a token every 30 ms: a batch generates for longer than a
    step trains): killed right after the checkpoint of step 2, whose record holds partial
    rollouts; the resumed run sends each of them again as its prompt plus its recorded tokens,
    with its seed (never from its prompt alone), records every step once, and ends with the
    sampler and batches in flight of an uninterrupted run: every prompt drawn exactly once."""
    fake = _sglang_stand_in()
    overrides = [
        *TINY, "rollout=sglang", "rollout.sglang.weight_sync=disk", "rollout.mode=async",
        "rollout.max_staleness=2", "rollout.max_new_tokens=32", "trainer.steps=4",
        "trainer.save_every=2", "+rollout.sglang.samples_per_request=4",
    ]  # fmt: skip
    runs = {}
    for name, faults in (("straight", [None]), ("killed", ["kill_after_publish=1", None])):
        server = fake.start_fake_server(
            routed_experts=False, vocab_size=48, extra_args=["--token-delay-s", "0.03"]
        )
        try:
            run = tmp_path / name
            for fault in faults:
                gspo_train(
                    run, *overrides, f"+rollout.sglang.urls=[{server.url}]",
                    f"+rollout.sglang.disk_dir={tmp_path / name / 'weights'}",
                    faults=fault, expect="killed" if fault else "success",
                )  # fmt: skip
            runs[name] = (run, server.log())
        finally:
            server.stop()
    run, log = runs["killed"]
    held = json.loads((step_dir(run, 2) / "gspo_checkpoint.json").read_text())["extra"]
    assert held["in_flight"]["complete_samples"] < held["in_flight"]["samples"]
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["async/staleness_max"] <= 2 for r in records)
    # the sampler and the batches in flight at the end: those of the uninterrupted run
    ends = [
        json.loads((step_dir(r, 4) / "gspo_checkpoint.json").read_text())["extra"]
        for r in (runs["straight"][0], run)
    ]
    assert ends[0]["sampler"] == ends[1]["sampler"]
    assert ends[0]["in_flight"]["steps"] == ends[1]["in_flight"]["steps"]
    # the partial rollouts go on from their recorded tokens, with their seeds
    from gspo_megatron.checkpoint.safe_load import load_weights_only

    with open(step_dir(run, 2) / "rollout_inflight.pt", "rb") as f:
        record = load_weights_only(f, "rollout_inflight.pt")
    partial = [
        (s["prompt"].tolist(), s["response"].tolist())
        for b in record["batches"] for g in b["samples"] for s in g
        if not s["done"] and len(s["response"])
    ]  # fmt: skip
    assert partial
    resumed_at = max(i for i, e in enumerate(log) if e["path"] == "/update_weights_from_disk"
                     and e["body"].get("weight_version") == "2")  # fmt: skip
    later = [e["body"] for e in log[resumed_at:] if e["path"] == "/generate"]
    inputs = [ids for body in later for ids in body["input_ids"]]
    for prompt, tokens in partial:
        assert prompt + tokens in inputs, (prompt, tokens)
