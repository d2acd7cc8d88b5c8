"""Episodes at their own pace (rollout/episodes.py): a slow environment call holds up only its
own episode, on an engine on every rank (rounds) and on an engine outside the trainer (rank 0's
episode thread, one job per turn batch); turns in flight stay within env.max_concurrent_turns;
token versions follow the engine's through weight swaps; every rank sees the same episodes;
bad environments end their episode only, with a counted reason and a warning; a batch of
episodes runs ahead of the trainer in the rollout pipeline (rollout.mode one_step_off/async)."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import numpy as np
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
STOP = SamplingParams(max_new_tokens=6, stop_token_ids=(EOS,), seed=3)
DIGITS = [TOKENIZER.convert_tokens_to_ids(c) for c in "0123456789"]


def sampled(context, rng: random.Random, max_new_tokens: int):
    """Random digits ending with <eos>, with random log-probs (a model turn)."""
    ids = [rng.choice(DIGITS) for _ in range(rng.randint(0, max_new_tokens - 1))] + [EOS]
    return ids, [-rng.random() for _ in ids]


class RoundsEngine:
    """A driver stand-in for an engine on every rank: records each batch."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.batches: list[list[list[int]]] = []

    def generate(self, prompts, n, params):
        self.batches.append([list(p) for p in prompts])
        out = []
        for context in prompts:
            ids, lps = sampled(context, self.rng, params.max_new_tokens)
            routes = np.arange(len(context) + len(ids) - 1, dtype=np.int32)[:, None, None]
            out.append([RolloutSample(list(context), ids, lps, "stop", routed_experts=routes)])
        return out


class ServerEngine:
    """A ServerRolloutEngine stand-in: each job answers from a thread of its own after
    `latency_s`; `swap`: the job's later half of tokens carries the next weight version."""

    generates_on_every_rank = False
    resync_poll_s = 0.05

    def __init__(self, latency_s=0.0, one_at_a_time=False, swap=False, seed: int = 0) -> None:
        self.latency_s = latency_s
        self.runs_one_job_at_a_time = one_at_a_time
        self.swap = swap
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.version = 0
        self.turns_in_flight = self.jobs_in_flight = 0
        self.max_turns_in_flight = self.max_jobs_in_flight = 0
        self.jobs: list[tuple[int, int | None, bool]] = []  # (turns, min_version, urgent)

    def start_generate(self, prompts, n, params, *, min_version=None, urgent=False, progress=None):
        assert n == 1 and progress is None
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.jobs.append((len(prompts), min_version, urgent))
            self.turns_in_flight += len(prompts)
            self.jobs_in_flight += 1
            self.max_turns_in_flight = max(self.max_turns_in_flight, self.turns_in_flight)
            self.max_jobs_in_flight = max(self.max_jobs_in_flight, self.jobs_in_flight)

        def work() -> None:
            time.sleep(self.latency_s)
            with self.lock:
                out = []
                for context in prompts:
                    ids, lps = sampled(context, self.rng, params.max_new_tokens)
                    versions = [self.version] * len(ids)
                    if self.swap:
                        self.version += 1
                        versions[len(ids) // 2 :] = [self.version] * (len(ids) - len(ids) // 2)
                    out.append([RolloutSample(list(context), ids, lps, "stop",
                                              weight_version=versions[-1],
                                              token_versions=versions)])  # fmt: skip
                self.turns_in_flight -= len(prompts)
                self.jobs_in_flight -= 1
            future.job_stats = JobStats(sampled_tokens=sum(len(g[0].response_ids) for g in out))
            future.set_result(out)

        threading.Thread(target=work, daemon=True).start()
        return future

    def servers_to_resync(self):
        return []

    def snapshot(self, jobs):
        raise AssertionError("a batch of episodes is recorded without asking the engine")


def prompts(count: int) -> list[Prompt]:
    return [Prompt(i, TOKENIZER.encode(f"{i}+{i}="), f"{i}+{i}=", str(i)) for i in range(count)]


def runner(name: str, ranks=None, **settings) -> EpisodeRunner:
    cfg = EnvConfig(name=f"{__name__}:{name}", **settings)
    return EpisodeRunner(cfg, TOKENIZER, ranks or SingleRank(), 160)


def driver(engine) -> RolloutDriver:
    return RolloutDriver(engine, SingleRank(), None)


def run(name: str, engine, count: int, n: int = 1, **settings):
    episodes = runner(name, **settings)
    rollouts = engine if isinstance(engine, RoundsEngine) else driver(engine)
    try:
        return [s for g in episodes.run(rollouts, prompts(count), n, STOP) for s in g]
    finally:
        episodes.close()


class Gate(Environment):
    """Three model turns per episode. The episode of label "0" answers its first turn only once
    every other episode is done (or after `patience_s`): a turn-synchronous loop could never
    finish the others first."""

    patience_s = 30.0
    others = 0
    finished = 0
    lock = threading.Lock()
    others_done = threading.Event()

    @classmethod
    def expect(cls, others: int) -> None:
        cls.others, cls.finished, cls.others_done = others, 0, threading.Event()

    def reset(self, prompt, label=None):
        self.label, self.turns = label, 0

    def step(self, turn):
        self.turns += 1
        if self.label == "0" and self.turns == 1:
            waited = self.others_done.wait(self.patience_s)
            return StepResult(observation="ok" if waited else "late")
        if self.turns < 3:
            return StepResult(observation=[7] * self.turns)
        if self.label != "0":
            with self.lock:
                Gate.finished += 1
                if Gate.finished == Gate.others:
                    Gate.others_done.set()
        return StepResult(done=True, reward=1.0)


def observed(sample: RolloutSample) -> list[int]:
    return [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m == 0]


@pytest.mark.parametrize("engine", ["rounds", "server", "server-one-job-at-a-time"])
def test_a_slow_environment_call_stalls_only_its_own_episode(engine):
    Gate.expect(others=5)
    fake = {
        "rounds": RoundsEngine,
        "server": lambda: ServerEngine(0.01),
        "server-one-job-at-a-time": lambda: ServerEngine(0.01, one_at_a_time=True),
    }[engine]()
    samples = run("Gate", fake, 6, executor="thread", timeout_s=60.0)
    slow = samples[0]
    assert TOKENIZER.decode(observed(slow)).count("ok") == 1  # the others finished first
    assert all(s.episode.turns == 3 and s.finish_reason == "stop" for s in samples)
    assert all(s.episode.env_reward == 1.0 and s.episode.failure is None for s in samples)
    if engine == "rounds":
        # the slow episode's last two turns came in batches of their own, after the others
        trajectory = slow.prompt_ids + slow.response_ids
        for (context,) in fake.batches[-2:]:
            assert trajectory[: len(context)] == context


class Walk(Environment):
    """Random observations (text or ids) for 1-4 turns, some calls slow: a workload to check
    trajectories against the engine's records."""

    inline_safe = False

    def reset(self, prompt, label=None):
        self.rng = random.Random(prompt)
        self.left = self.rng.randint(1, 4)

    def step(self, turn):
        time.sleep(self.rng.choice([0.0, 0.0, 0.02]))
        self.left -= 1
        if self.left == 0:
            return StepResult(done=True)
        if self.rng.random() < 0.5:
            return StepResult(observation="9" * self.rng.randint(1, 6))
        return StepResult(observation=[self.rng.randrange(4, 40) for _ in range(3)])


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_turns_in_flight_stay_within_the_limit_and_tokens_keep_their_versions(one_at_a_time):
    engine = ServerEngine(0.005, one_at_a_time=one_at_a_time, swap=True)
    samples = run("Walk", engine, 12, 2, executor="thread", max_concurrent_turns=5)
    assert engine.max_turns_in_flight <= 5
    if one_at_a_time:
        assert engine.max_jobs_in_flight == 1
        assert max(turns for turns, _, _ in engine.jobs) > 1  # due turns went together
    else:
        assert engine.max_turns_in_flight > 1
    for s in samples:
        versions = s.versions()
        assert len(versions) == len(s.response_ids) == len(s.loss_mask)
        assert versions == sorted(versions)  # a later token never has older weights
        for j, m in enumerate(s.loss_mask):
            if m == 0:  # an observation's token takes the version of the token before it
                assert versions[j] == versions[j - 1]
        assert s.weight_version == versions[-1]
    assert any(len(set(s.versions())) > 1 for s in samples)


class Bad(Environment):
    """Per label: raise, hang, a malformed observation, an observation past the budget, or
    a good episode of two turns."""

    def reset(self, prompt, label=None):
        self.kind, self.turns = int(label) % 5, 0

    def step(self, turn):
        self.turns += 1
        if self.kind == 0:
            raise RuntimeError("tool exploded")
        if self.kind == 1:
            time.sleep(60)
        if self.kind == 2:
            return StepResult(observation={"not": "an observation"})
        if self.kind == 3:
            return StepResult(observation=[5] * 500)
        return StepResult(done=self.turns == 2, observation=None if self.turns == 2 else "go")


@pytest.mark.parametrize("engine", ["rounds", "server"])
def test_bad_environments_end_their_episode_with_a_reason_and_a_warning(engine, caplog):
    fake = RoundsEngine() if engine == "rounds" else ServerEngine(0.005)
    started = time.monotonic()
    samples = run("Bad", fake, 10, executor="thread", timeout_s=1.0)
    assert time.monotonic() - started < 30  # a hung call is abandoned at its timeout
    by_kind = {}
    for p, s in zip(prompts(10), samples, strict=True):
        by_kind.setdefault(int(p.label) % 5, []).append(s)
    assert all(s.episode.failure == "error" for s in by_kind[0])
    assert all(s.episode.failure == "timeout" for s in by_kind[1])
    assert all(s.episode.failure == "malformed" for s in by_kind[2])
    assert all(s.episode.truncated_observation and s.finish_reason == "length"
               for s in by_kind[3])  # fmt: skip
    assert all(s.episode.failure is None and s.episode.turns == 2 for s in by_kind[4])
    (warning,) = [
        r.getMessage() for r in caplog.records if r.name == "gspo_megatron.rollout.episodes"
    ]
    assert f"{__name__}:Bad" in warning and "6 of 10 episodes" in warning
    assert "(2 raised, 2 timed out, 2 malformed answers)" in warning
    assert "tool exploded" in warning or "no answer within" in warning or "must return" in warning


class ThreadRanks:
    """Two ranks as threads of one process: broadcast hands rank 0's object to rank 1."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.world_size, self.shared = rank, 2, shared

    def broadcast(self, obj):
        box, barrier = self.shared["box"], self.shared["barrier"]
        if self.rank == 0:
            box[0] = obj
        barrier.wait(timeout=60)
        out = box[0]
        barrier.wait(timeout=60)
        return out


def test_every_rank_generates_the_same_batches_and_gets_the_same_episodes():
    shared = {"box": [None], "barrier": threading.Barrier(2)}
    engines = [RoundsEngine(5), RoundsEngine(5)]  # the same model on both ranks
    results: list = [None, None]

    def rank(r: int) -> None:
        episodes = runner("Walk", ranks=ThreadRanks(r, shared), executor="thread")
        results[r] = episodes.run(engines[r], prompts(8), 2, STOP)
        episodes.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert engines[0].batches == engines[1].batches and len(engines[0].batches) > 1
    flat = [[(s.prompt_ids, s.response_ids, s.loss_mask, s.logprobs, s.episode) for g in res
             for s in g] for res in results]  # fmt: skip
    assert flat[0] == flat[1]


def test_batches_of_episodes_run_ahead_in_the_rollout_pipeline():
    """rollout.mode async with an environment: each batch's turn jobs carry its min_version,
    the batch is recorded as not started at a checkpoint, and an abandoned batch's thread
    stops."""
    engine = ServerEngine(0.002)
    rollouts = driver(engine)
    data = prompts(16)
    episodes = runner("Walk", executor="thread")
    pipeline = RolloutPipeline(
        rollouts, PromptSampler(data, 4, seed=0, shuffle=True), SingleRank(),
        depth=2, max_staleness=1, group_size=2,
        params_for=lambda step: SamplingParams(max_new_tokens=6, stop_token_ids=(EOS,),
                                               seed=step),
        episodes=episodes,
    )  # fmt: skip
    for step in range(3):
        taken, groups, stats = pipeline.take(step)
        assert len(groups) == 4 and all(len(g) == 2 for g in groups)
        assert [g[0].prompt_ids for g in groups] == [p.prompt_ids for p in taken]
        assert all(s.episode.turns >= 1 for g in groups for s in g)
        assert stats["async/sampled_tokens"] > 0
        rollouts.version = step + 1
    for a in pipeline.ahead:
        a.submitted.job.result(timeout=60)
    assert {v for _, v, _ in engine.jobs} == {0, 1, 2, 3}  # max(step - 1, 0) for steps 0..4
    record = pipeline.in_flight()
    assert [b.step for b in record] == [3, 4]
    assert all(b.progress.tokens() == 0 and not b.progress.complete for b in record)
    pipeline.abandon()
    episodes.close()


def test_an_abandoned_batch_of_episodes_stops():
    episodes = runner("Walk", executor="thread")
    submitted = episodes.submit(driver(ServerEngine(0.05)), prompts(8), 2, STOP, min_version=0)
    submitted.job.cancel_episodes()
    with pytest.raises(concurrent.futures.CancelledError):
        submitted.job.result(timeout=30)
    # as the driver gives up on a batch: cancelling its future stops its episodes too
    other = episodes.submit(driver(ServerEngine(0.05)), prompts(8), 2, STOP, min_version=0)
    assert other.job.cancel()
    deadline = time.monotonic() + 10
    while any(t.name == "episodes" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    episodes.close()
