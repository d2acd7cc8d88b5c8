"""Batches of episodes streamed by the rollout pipeline (rollout.mode one_step_off / async with an
environment, rollout/pipeline.py): no batch barrier within the staleness bound.

With an engine that starts a job only once its weights reach the job's `min_version` (as the
generator process and SGLang do) and one slow episode per batch: the next batch's episodes start
before the slowest episode of the batch the trainer waits for ends; every token's version is
within rollout.max_staleness of the weights that train on it; every step is taken once, in step
order, with the prompts the sampler draws for it; and the samples equal, token for token, those
of the same batches run one after the other (a deterministic engine and environment: the
streamed schedule changes when things happen, not what they produce).
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from gspo_megatron.data.dataset import Prompt
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.data.tokenizer import build_tool_char_tokenizer
from gspo_megatron.envs import Environment, StepResult
from gspo_megatron.envs.registry import EnvConfig
from gspo_megatron.ranks import SingleRank
from gspo_megatron.rollout.base import JobStats, RolloutSample, SamplingParams
from gspo_megatron.rollout.driver import RolloutDriver
from gspo_megatron.rollout.episodes import EpisodeRunner
from gspo_megatron.rollout.pipeline import RolloutPipeline

TOKENIZER = build_tool_char_tokenizer()
EOS = TOKENIZER.eos_token_id
DIGITS = [TOKENIZER.convert_tokens_to_ids(c) for c in "0123456789"]
PER_STEP, GROUP, STEPS = 4, 2, 4


class GatedEngine:
    """A ServerRolloutEngine stand-in: a job starts (in a thread of its own) once the engine's
    weights reach its min_version; each turn's tokens are a function of its context alone, and
    carry the engine's version when the job started."""

    generates_on_every_rank = False
    resync_poll_s = 0.05
    runs_one_job_at_a_time = False

    def __init__(self, latency_s: float = 0.01) -> None:
        self.latency_s = latency_s
        self.version = 0
        self.changed = threading.Condition()

    def update_weights(self, source, version, urls=None):
        with self.changed:
            self.version = version
            self.changed.notify_all()

    def start_generate(self, prompts, n, params, *, min_version=None, urgent=False, progress=None):
        assert n == 1 and progress is None and min_version is not None
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            with self.changed:
                self.changed.wait_for(lambda: self.version >= min_version)
                version = self.version
            time.sleep(self.latency_s)
            out = []
            for context in prompts:
                rng = random.Random(str(context))
                ids = [rng.choice(DIGITS) for _ in range(rng.randint(0, 4))] + [EOS]
                out.append([RolloutSample(list(context), ids, [-rng.random() for _ in ids],
                                          "stop", weight_version=version)])  # fmt: skip
            future.job_stats = JobStats(sampled_tokens=sum(len(g[0].response_ids) for g in out))
            future.set_result(out)

        threading.Thread(target=work, daemon=True).start()
        return future

    def servers_to_resync(self):
        return []

    def snapshot(self, jobs):
        raise AssertionError("a batch of episodes is recorded without asking the engine")


class Slow(Environment):
    """Three model turns; the episodes of every fourth prompt (one per batch) take `slow_s` per
    tool call. Logs when each episode starts and ends."""

    slow_s = 0.5
    log: list[tuple[str, str, float]] = []
    lock = threading.Lock()

    def reset(self, prompt, label=None):
        self.label, self.turns = label, 0
        self._note("start")

    def step(self, turn):
        self.turns += 1
        if self.turns == 3:
            self._note("end")
            return StepResult(done=True, reward=1.0)
        if int(self.label) % PER_STEP == 0:
            time.sleep(self.slow_s)
        return StepResult(observation=[7] * self.turns)

    def _note(self, what: str) -> None:
        with self.lock:
            Slow.log.append((self.label, what, time.monotonic()))


def data() -> list[Prompt]:
    return [Prompt(i, TOKENIZER.encode(f"{i}+{i}="), f"{i}+{i}=", str(i)) for i in range(32)]


def params_for(step: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=6, stop_token_ids=(EOS,), seed=step)


def content(groups) -> list:
    """What a sample holds apart from the versions that sampled it."""
    return [(s.prompt_ids, s.response_ids, s.logprobs, s.loss_mask, s.finish_reason,
             s.episode.turns, s.episode.env_reward) for g in groups for s in g]  # fmt: skip


@pytest.mark.parametrize(
    ("depth", "bound"), [(1, 1), (2, 1), (2, 2)], ids=["one-step-off", "async-q2-s1", "async-q2-s2"]
)
def test_the_next_batch_of_episodes_runs_beside_the_stragglers(depth, bound):
    Slow.log = []
    engine = GatedEngine()
    rollouts = RolloutDriver(engine, SingleRank(), None)
    episodes = EpisodeRunner(EnvConfig(name=f"{__name__}:Slow", executor="thread",
                                       max_turns=3), TOKENIZER, SingleRank(), 160)  # fmt: skip
    pipeline = RolloutPipeline(
        rollouts, PromptSampler(data(), PER_STEP, seed=0, shuffle=False), SingleRank(),
        depth=depth, max_staleness=bound, group_size=GROUP, params_for=params_for,
        episodes=episodes,
    )  # fmt: skip
    taken, came = [], []
    try:
        for step in range(STEPS):
            came.append(time.monotonic())  # the trainer comes for batch `step`
            prompts, groups, _ = pipeline.take(step)
            taken.append((prompts, groups))
            rollouts.update_weights(step + 1)  # the step trained
        pipeline.abandon()
        streamed = list(Slow.log)
        # the same batches, one after the other (a synchronous run's order)
        for step, (prompts, groups) in enumerate(taken):
            assert [p.label for p in prompts] == [str(i) for i in range(4 * step, 4 * step + 4)]
            rollouts.update_weights(step)
            alone = episodes.run(rollouts, prompts, GROUP, params_for(step), min_version=step)
            assert content(groups) == content(alone)
    finally:
        episodes.close()
    for step, (_, groups) in enumerate(taken):
        versions = [v for g in groups for s in g for v in s.versions()]
        assert max(step - v for v in versions) <= bound and max(versions) <= step
        assert all(s.episode.turns == 3 and s.episode.env_reward == 1.0 for g in groups for s in g)
    # No batch barrier: batch k+1's episodes had started when the trainer came for batch k
    # (within a loaded machine's thread start), and ran while the trainer waited for a straggler
    # of batch k (its first prompt's episodes: 1 s of tool calls) at least once.
    start = {label: t for label, what, t in streamed if what == "start"}
    end = {label: t for label, what, t in streamed if what == "end"}
    overlapped = 0
    for step in range(STEPS - 1):
        slowest = end[str(PER_STEP * step)]
        following = min(start[str(i)] for i in range(PER_STEP * (step + 1), PER_STEP * (step + 2)))
        assert following < came[step] + 0.5, f"batch {step + 1} waited for batch {step}"
        overlapped += following < slowest and came[step] < slowest
    assert overlapped
