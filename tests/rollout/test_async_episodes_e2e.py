"""Multi-turn episodes under rollout.mode one_step_off / async through `gspo-train` on the embedded
engine's generator process and on SGLang (the stand-in): the episode loop runs on rank 0 beside
the training, every turn a job of the engine under the staleness bound (the generator process
keeps each episode's K/V between its turns' jobs); a kill -9 in the middle of the asynchronous
episodes leaves no generator or environment worker behind, and the resumed run records every
step once."""

from __future__ import annotations

import time

import psutil
import pytest
from trainer.test_train_e2e import MULTI_TURN, _sglang_stand_in, _train_on, metrics, train

# environment calls in worker processes, so that "nothing left behind" covers them too
EPISODES = (*MULTI_TURN, "env.executor=process", "env.workers=2", "algorithm.routing_replay=r3")


def _orphans(started: float) -> list[int]:
    """Generator processes and environment workers started since `started` whose parent is
    gone (adopted by a process that is not Python: init or a subreaper); other sessions'
    running ones have their trainer as parent."""
    marks = ("spawn_main", "gspo_megatron.isolation.worker")
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        if p.info["create_time"] < started:
            continue
        if not any(m in " ".join(p.info["cmdline"] or []) for m in marks):
            continue
        try:
            parent = p.parent()
            adopted = parent is None or "python" not in " ".join(parent.cmdline())
        except psutil.Error:
            adopted = False  # it ended while we looked
        if adopted:
            out.append(p.info["pid"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_episodes_generated_ahead_through_gspo_train(tmp_path, mode):
    started = time.time()
    train(tmp_path, *EPISODES, f"rollout.mode={mode}", "rollout.max_staleness=1",
          "trainer.steps=3", "eval.every=3")  # fmt: skip
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(1 < r["env/turns_mean"] <= 4 for r in records)
    assert all(0 < r["env/model_token_fraction"] < 1 for r in records)
    assert all(r["async/staleness_max"] <= 1 and r["async/dropped_samples"] == 0 for r in records)
    assert all(r["actor/optimizer_steps"] >= 1 for r in records)
    assert "eval/pass@1" in records[-1]
    # the generator process keeps an episode's K/V between its turns' jobs
    assert sum(r["rollout/prefix_cache_reused_tokens"] for r in records) > 0
    assert all(r["rollout/prefill_tokens"] > 0 for r in records)
    time.sleep(1)
    assert not _orphans(started)


@pytest.mark.slow
def test_async_episodes_killed_and_resumed_record_every_step_once(tmp_path):
    common = [
        *EPISODES, "rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2",
        "trainer.steps=5", "trainer.save_every=2", "eval.every=5",
    ]  # fmt: skip
    started = time.time()
    # num_minibatches=4 optimizer steps per RL step: the 10th is in step 3
    killed = train(tmp_path, *common, check=False, faults="kill_after_optimizer_step=10")
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    assert "leaked semaphore" not in killed.stderr, killed.stderr[-2000:]
    time.sleep(2)  # the generator and the workers notice their trainer is gone within 0.5 s
    assert not _orphans(started)
    resumed = train(tmp_path, *common)
    assert "resumed at step 2" in resumed.stderr
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in records)
    assert all(r["env/turns_mean"] > 1 for r in records)
    time.sleep(1)
    assert not _orphans(started)


def test_async_episodes_on_sglang(tmp_path):
    """rollout.mode=async on SGLang (the stand-in, tokens of 10 ms): each turn a /generate
    request with the whole trajectory, sent while steps train; weight updates abort and continue
    the requests running; every token within the staleness bound."""
    fake = _sglang_stand_in()
    server = fake.start_fake_server(
        routed_experts=False, vocab_size=80, extra_args=["--token-delay-s", "0.01"]
    )
    log = _train_on(
        server, tmp_path, *MULTI_TURN, "trainer.steps=3", "eval.every=0", "rollout.mode=async",
        "rollout.max_staleness=1",
    )  # fmt: skip
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["env/turns_mean"] > 1 for r in records)
    assert all(r["async/staleness_max"] <= 1 and r["async/dropped_samples"] == 0 for r in records)
    assert sum(e["path"] == "/generate" for e in log) > 3 * 8  # a request per turn
