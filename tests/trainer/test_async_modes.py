"""rollout.mode one_step_off / async through `Trainer.train()` with fake engines
(tests/trainer/fakes.py, FakeGeneratorProcess: jobs run in order, each once the published
weights reach its min_version, like the generator process).

Checked: which weights generate each step's batch, with the seeds and prompts a synchronous run
uses; the staleness bound over whole runs, from every token's version; groups over the bound
dropped and counted; the partial-rollout mask; a resume redraws the batches that were in flight
(no step's prompts lost or repeated); every refused combination names its keys.
"""

from __future__ import annotations

import pytest
from trainer.fakes import SMALL, MemoryCheckpoints, build_fake_run

from gspo_megatron.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def run_fake(composer, tokenizer, *overrides: str, checkpoints=None, setup=None):
    cfg, model, layout = composer.resolve(*overrides)
    run = build_fake_run(cfg, model, layout, tokenizer, checkpoints=checkpoints)
    if setup is not None:
        setup(run.rollout)
    run.train()
    return run


def trained_versions(run) -> list[list[int]]:
    """Per RL step, the versions of every token the step trained on (from the journal)."""
    steps = []
    for call in run.journal.calls("generate"):
        steps.append([v for g in call.groups for s in g for v in s.versions()])
    return steps


@pytest.mark.parametrize(
    ("mode", "overrides", "versions"),
    [
        # J(s) (the batch of step s+1) waits for weights s - max_staleness; the first batch of a
        # run generates before anything trained.
        ("one_step_off", (), [0, 0, 1, 2, 3]),
        ("async", ("rollout.queue_batches=3", "rollout.max_staleness=2"), [0, 0, 0, 1, 2]),
        ("async", ("rollout.queue_batches=2", "rollout.max_staleness=1"), [0, 0, 1, 2, 3]),
    ],
    ids=["one-step-off", "async-q3-s2", "async-q2-s1"],
)
def test_batches_generate_ahead_within_the_bound(composer, tokenizer, mode, overrides, versions):
    steps = 5
    run = run_fake(composer, tokenizer, f"rollout.mode={mode}", "trainer.steps=5", *overrides)
    sync = run_fake(composer, tokenizer, "trainer.steps=5")
    jobs = run.rollout.jobs
    bound = run.cfg.rollout.max_staleness
    depth = run.cfg.rollout.queue_batches if mode == "async" else 1
    assert len(jobs) == steps + depth  # the last step leaves `depth` batches in flight
    assert [j["version"] for j in jobs[:steps]] == versions
    assert [j["min_version"] for j in jobs] == [max(s - bound, 0) for s in range(len(jobs))]
    # the prompts and seeds of a synchronous run, step for step
    sync_calls = sync.journal.calls("generate")
    for job, call in zip(jobs[:steps], sync_calls, strict=True):
        assert job["prompts"] == call.prompts and job["params"].seed == call.params.seed
    trained = trained_versions(run)[:steps]
    for step, (record, tokens) in enumerate(zip(run.log.records, trained, strict=True)):
        lags = [step - v for v in tokens]
        assert max(lags) <= bound
        metrics = record[1]
        assert metrics["async/staleness_max"] == max(lags)
        assert metrics["async/staleness_mean"] == pytest.approx(sum(lags) / len(lags))
        assert metrics["async/dropped_samples"] == 0
        assert metrics["async/queue_depth"] == depth


def test_groups_over_the_bound_are_dropped_and_counted(composer, tokenizer, capsys):
    def stale_first_group(rollout):
        rollout.extra_lag = {0: 3}

    run = run_fake(
        composer, tokenizer, "rollout.mode=one_step_off", "trainer.steps=2", setup=stale_first_group
    )
    group = run.cfg.rollout.group_size
    for _, metrics in run.log.records:
        assert metrics["async/dropped_samples"] == group
        assert metrics["sampling/groups_used"] == run.cfg.rollout.prompts_per_step - 1
    trains = run.journal.calls("train")
    assert all(len(t.samples) == group * 3 // 2 for t in trains)  # 3 groups, 2 minibatches
    assert "samples older than rollout.max_staleness=1 dropped" in capsys.readouterr().err


def test_partial_rollout_mask_leaves_tokens_before_the_last_swap_out(composer, tokenizer):
    def swap_after_two(rollout):
        rollout.swap_after = 2

    overrides = ("rollout.mode=async", "trainer.steps=2", "rollout.max_new_tokens=6")
    masked = run_fake(
        composer, tokenizer, *overrides, "rollout.partial_rollout_mask=true", setup=swap_after_two
    )
    plain = run_fake(composer, tokenizer, *overrides, setup=swap_after_two)
    count = 0
    for call in masked.journal.calls("train"):
        for sample in call.samples:
            n = len(sample.response_ids)
            if n > 2:
                assert sample.loss_mask == [0.0, 0.0] + [1.0] * (n - 2)
                count += 2
            else:
                assert sample.loss_mask is None
    assert count and sum(m["async/masked_tokens"] for _, m in masked.log.records) == count
    assert all(s.loss_mask is None for c in plain.journal.calls("train") for s in c.samples)


def trained_responses(run) -> list[list[list[int]]]:
    """Per optimizer step, the responses it trained on (in the order it took them)."""
    return [[list(s.response_ids) for s in c.samples] for c in run.journal.calls("train")]


def stable(records) -> list[dict]:
    """Records without what depends on timing or on where the run was resumed."""
    moved = ("time/", "perf/", "async/restored_tokens", "async/sampled_tokens")
    return [(s, {k: v for k, v in m.items() if not k.startswith(moved)}) for s, m in records]


def test_resume_continues_the_batches_in_flight(composer, tokenizer):
    """A checkpoint holds the batches generated ahead; the resumed run trains on them as they
    were (none generated again) and ends where an uninterrupted run ends."""
    overrides = ("rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2")
    whole = run_fake(composer, tokenizer, *overrides, "trainer.steps=4")
    store = MemoryCheckpoints()
    first = run_fake(composer, tokenizer, *overrides, "trainer.steps=2", checkpoints=store)
    state, _, files = store.saved[2]
    assert state["in_flight"]["steps"] == [2, 3]
    assert state["in_flight"]["complete_samples"] == state["in_flight"]["samples"] == 32
    resumed = run_fake(composer, tokenizer, *overrides, "trainer.steps=4", checkpoints=store)
    assert trained_responses(first) + trained_responses(resumed) == trained_responses(whole)
    assert stable(first.log.records[:2]) + stable(resumed.log.records) == stable(whole.log.records)
    assert resumed.log.rewinds == [2]
    # the batches of steps 3 and 4 come from the checkpoint: the engine's first job is step 5's
    assert resumed.rollout.jobs[0]["prompts"] == whole.rollout.jobs[4]["prompts"]
    restored = [m["async/restored_tokens"] for _, m in resumed.log.records]
    assert restored == [m["response/tokens"] for _, m in resumed.log.records]
    assert [m["async/sampled_tokens"] for _, m in resumed.log.records] == [0.0, 0.0]


def test_a_record_this_run_cannot_use_is_said_and_generated_again(composer, tokenizer, capsys):
    overrides = ("rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2")
    whole = run_fake(composer, tokenizer, *overrides, "trainer.steps=3")
    store = MemoryCheckpoints()
    run_fake(composer, tokenizer, *overrides, "trainer.steps=2", checkpoints=store)
    resumed = run_fake(
        composer, tokenizer, *overrides, "trainer.steps=3", "rollout.temperature=0.5",
        checkpoints=store,
    )  # fmt: skip
    err = capsys.readouterr().err
    assert "2 batches in flight at the checkpoint are generated again" in err
    assert "sampled with other settings" in err
    # the sampler went back before them: step 3's prompts, generated anew
    assert resumed.rollout.jobs[0]["prompts"] == whole.rollout.jobs[2]["prompts"]
    assert [m["async/restored_tokens"] for _, m in resumed.log.records] == [0.0]


def test_restored_groups_past_a_lower_bound_are_dropped_and_counted(composer, tokenizer):
    overrides = ("rollout.mode=async", "rollout.queue_batches=3")
    store = MemoryCheckpoints()
    run_fake(
        composer, tokenizer, *overrides, "rollout.max_staleness=3", "trainer.steps=2",
        checkpoints=store,
    )  # fmt: skip
    # steps 3..5 were generated with version 0 (bound 3); resumed with a bound of 1
    resumed = run_fake(
        composer, tokenizer, *overrides, "rollout.max_staleness=1", "trainer.steps=3",
        checkpoints=store,
    )  # fmt: skip
    ((_, metrics),) = resumed.log.records
    assert metrics["async/dropped_samples"] == 16  # step 3's whole batch: lag 2 > 1
    assert metrics["sampling/groups_used"] == 0


def test_evaluation_goes_before_queued_batches_with_current_weights(composer, tokenizer):
    run = run_fake(
        composer,
        tokenizer,
        "rollout.mode=async",
        "rollout.queue_batches=3",
        "rollout.max_staleness=3",
        "trainer.steps=2",
        "eval.every=1",
        "data.num_eval=4",
    )
    evals = [j for j in run.rollout.jobs if j["urgent"]]
    assert [(j["min_version"], j["version"]) for j in evals] == [(1, 1), (2, 2)]
    assert all("eval/pass@1" in m for _, m in run.log.records)


@pytest.mark.parametrize(
    ("overrides", "keys", "reason"),
    [
        (("rollout.max_staleness=-1",), ["rollout.max_staleness"], ">= 0"),
        (("rollout.queue_batches=0",), ["rollout.queue_batches"], ">= 1"),
        (
            ("rollout.mode=async", "rollout.max_staleness=0"),
            ["rollout.mode=async", "rollout.max_staleness >= 1"],
            "weights one version old",
        ),
        (
            ("rollout.mode=async", "trainer.offload_during_rollout=optimizer"),
            ["trainer.offload_during_rollout=optimizer", "rollout.mode=async"],
            "generation overlaps training",
        ),
        (
            ("rollout.mode=one_step_off", "algorithm.dynamic_sampling=dapo"),
            ["algorithm.dynamic_sampling=dapo", "rollout.mode=one_step_off"],
            "refill rounds",
        ),
        (
            ("rollout.partial_rollout_mask=true",),
            ["rollout.partial_rollout_mask", "rollout.mode=async"],
            "only async mode swaps weights",
        ),
        (
            ("rollout.mode=one_step_off", "rollout.partial_rollout_mask=true"),
            ["rollout.partial_rollout_mask", "rollout.mode=async"],
            "only between batches",
        ),
        (
            ("rollout.mode=one_step_off", "rollout.pin_versions=true"),
            ["rollout.pin_versions", "rollout.mode=one_step_off"],
            "always samples a batch with one version",
        ),
        (
            (
                "rollout.mode=async",
                "rollout.pin_versions=true",
                "rollout.partial_rollout_mask=true",
            ),
            ["rollout.partial_rollout_mask", "rollout.pin_versions"],
            "nothing to mask",
        ),
    ],
    ids=[
        "negative-staleness",
        "queue-below-one-batch",
        "async-without-staleness",
        "offload",
        "dapo",
        "mask-in-sync",
        "mask-in-one-step-off",
        "pin-in-one-step-off",
        "pin-with-mask",
    ],
)
def test_refused_combinations_name_their_keys(composer, overrides, keys, reason):
    with pytest.raises(ConfigError) as err:
        composer.resolve(*overrides)
    for key in (*keys, reason):
        assert key in str(err.value)


@pytest.mark.parametrize(
    ("mode", "sglang", "keys", "reason"),
    [
        ("async", {}, ["rollout.sglang.weight_sync=tensor", "rollout.mode=async"],
         "servers of their own"),
        (
            "one_step_off",
            {"weight_sync": "disk", "disk_dir": "/tmp/w", "offload_after_generate": True,
             "launch": [{"model_path": "m", "enable_memory_saver": True}]},
            ["rollout.sglang.offload_after_generate", "rollout.mode=one_step_off"],
            "cannot leave",
        ),
        ("async", {"weight_sync": "disk", "disk_dir": "/tmp/w"},
         ["rollout.pin_versions", "rollout.engine=sglang"], "servers are not"),
    ],
    ids=["sglang-tensor", "sglang-offload", "sglang-pinned"],
)  # fmt: skip
def test_refused_sglang_combinations_name_their_keys(composer, mode, sglang, keys, reason):
    from gspo_megatron.config import resolve

    pinned = ("rollout.pin_versions=true",) if "rollout.pin_versions" in keys else ()
    raw = composer.raw(*SMALL, "rollout=sglang", f"rollout.mode={mode}", *pinned)
    raw["rollout"]["sglang"].update(urls=["http://127.0.0.1:1"], **sglang)
    with pytest.raises(ConfigError) as err:
        resolve(raw, 1)
    for key in (*keys, reason):
        assert key in str(err.value)


def test_an_export_the_mapping_cannot_write_is_refused_at_config_time(composer):
    from gspo_megatron.config import resolve

    raw = composer.raw("trainer.export_hf_every=2")
    raw["model"]["attention_bias"] = True  # a Qwen3 variant the HF mapping refuses
    with pytest.raises(ConfigError) as err:
        resolve(raw, 1)
    for said in ("trainer.export_hf_every=2", "attention_bias", "trainer.export_hf_every=0"):
        assert said in str(err.value)
