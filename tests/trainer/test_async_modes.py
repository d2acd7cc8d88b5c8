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


def test_resume_draws_the_batches_in_flight_again(composer, tokenizer):
    overrides = ("rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2")
    whole = run_fake(composer, tokenizer, *overrides, "trainer.steps=4")
    store = MemoryCheckpoints()
    first = run_fake(composer, tokenizer, *overrides, "trainer.steps=2", checkpoints=store)
    resumed = run_fake(composer, tokenizer, *overrides, "trainer.steps=4", checkpoints=store)
    trained = [c.prompts for c in whole.journal.calls("generate")][:4]
    split = [c.prompts for c in first.journal.calls("generate")][:2] + [
        c.prompts for c in resumed.journal.calls("generate")
    ][:2]
    assert split == trained  # no step's prompts lost or repeated
    assert resumed.log.rewinds == [2]
    assert [s for s, _ in resumed.log.records] == [3, 4]
    # the resumed run generates its first batch with the resumed weights
    assert resumed.rollout.jobs[0]["version"] == 2


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
    ],
    ids=[
        "negative-staleness",
        "queue-below-one-batch",
        "async-without-staleness",
        "offload",
        "dapo",
        "mask-in-sync",
        "mask-in-one-step-off",
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
    ],
    ids=["sglang-tensor", "sglang-offload"],
)  # fmt: skip
def test_refused_sglang_combinations_name_their_keys(composer, mode, sglang, keys, reason):
    from gspo_megatron.config import resolve

    raw = composer.raw(*SMALL, "rollout=sglang", f"rollout.mode={mode}")
    raw["rollout"]["sglang"].update(urls=["http://127.0.0.1:1"], **sglang)
    with pytest.raises(ConfigError) as err:
        resolve(raw, 1)
    for key in (*keys, reason):
        assert key in str(err.value)
