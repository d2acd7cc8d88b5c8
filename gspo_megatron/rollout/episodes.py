"""Multi-turn episodes: a model turn, the environment's answer, the next model turn, ...

Each episode goes at its own pace: it generates a turn, calls its environment, appends the
observation and generates again, without waiting for the other episodes. Environments live on
rank 0 (`EnvCalls.submit`: one call per episode as it needs one, inline, in a thread or in a
worker process), so a slow or hung call holds up only its own episode. How turns reach the
engine:

- An engine that generates on every rank (the embedded engine in the trainer): rounds. Rank 0
  waits until at least one environment has answered, then for more answers for up to the last
  round's generation time (a round costs about as much for one episode as for many), takes every
  answer that has arrived and shares them; every rank appends them and generates, as one batch,
  a turn for every episode that is due one (the engine splits it by rollout.max_batch_tokens).
  Answers that arrive while a batch runs join the next one. Every rank so holds the same
  trajectories and calls the engine with the same batches. With inline environments the rounds
  are exactly the turns of a turn-by-turn loop.
- An engine outside the trainer (SGLang servers; the generator process of rollout.mode
  one_step_off / async): rank 0 runs the episodes in a thread of its own (`submit`: one future
  for the whole batch, which the driver waits for as for any generate job, and which the
  rollout pipeline keeps running while the trainer trains; every batch has a thread of its
  own, so the episodes of all the batches in flight go together). An episode's turn goes to the
  engine as soon as it is due, with at most env.max_concurrent_turns turns in flight; to an
  engine that runs one job at a time (`runs_one_job_at_a_time`: the generator process) the
  turns that become due while a job runs go together as the next job. Every turn job carries
  the batch's `min_version` (the staleness bound); with partial rollouts a turn may span a
  weight update, and every token keeps the version that sampled it (an observation's tokens
  take the version of the model token before them).

Sampling seeds: round (or turn job) r is sampled with the call's seed derived for r, so with
environments whose answers take varying time, which episodes share a batch, and so their
streams, depend on timing.

Token-in / token-out: an episode is kept as token ids. A turn appends the ids the engine sampled
with their log-probs and loss mask 1; an observation appends the ids its chat-template rendering
adds (gspo_megatron/envs/chat.py) with loss mask 0 and log-prob 0 (a placeholder: masked
everywhere). Nothing already in the trajectory is tokenised again. The sample's prompt is the
initial context and its response everything after it; its routes (R3) are those of the last
turn's request, whose prompt was the whole trajectory before it, so they cover every token.

Limits: `env.max_turns` model turns, `env.max_tokens` tokens after the initial context (and the
engine's maximum sequence length). A turn cut by its own token budget, a turn or an observation
past the episode's budget, or a last turn after which the environment wanted more, ends the
episode with finish reason "length"; an observation never ends a trajectory (the last token is
always the model's, so the routes of the last request cover everything).

Bad environments: a call that raises or runs past env.timeout_s, and an answer outside the
contract (envs/base.py: a malformed observation, reward or initial context), end that episode
only, with reward 0 and the failure recorded ("error", "timeout", "malformed"); the first
failure of each call of `run`/`submit` is logged at warning level with the environment's name
and the error, with the count of the others.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import math
import pickle
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gspo_megatron.envs.base import (
    EnvironmentContractError,
    StepResult,
    check_observation,
    check_step_result,
)
from gspo_megatron.envs.calls import CallOutcome, EnvCalls
from gspo_megatron.envs.chat import ChatFormat
from gspo_megatron.envs.registry import environment_class
from gspo_megatron.rollout.base import EpisodeRecord, JobStats, RolloutSample, SamplingParams
from gspo_megatron.rollout.driver import Submitted

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from gspo_megatron.data.dataset import Prompt
    from gspo_megatron.envs.registry import EnvConfig
    from gspo_megatron.ranks import Ranks
    from gspo_megatron.rollout.driver import RolloutDriver

# failures that end an episode with reward 0 and count as failed rewards
ENV_FAILURES = ("error", "timeout", "malformed")


@dataclass
class _Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # each response token's weight version
    finish: str | None = None  # set when the episode is over
    due: bool = False  # its environment has answered: a model turn is due
    last: RolloutSample | None = None  # the last turn's sample (version, routes)
    record: EpisodeRecord = field(default_factory=EpisodeRecord)

    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def room(self, max_tokens: int, max_sequence_length: int) -> int:
        return min(
            max_tokens - len(self.response_ids),
            max_sequence_length - len(self.prompt_ids) - len(self.response_ids),
        )

    def add_turn(self, sample: RolloutSample, room: int) -> None:
        ids, logprobs = sample.response_ids[:room], sample.logprobs[:room]
        self.record.answer_start = len(self.response_ids)
        self.record.turns += 1
        self.response_ids += ids
        self.logprobs += logprobs
        self.mask += [1] * len(ids)
        self.versions += sample.versions()[: len(ids)]
        self.last = sample
        if sample.finish_reason == "abort":
            self.finish = "abort"
        elif sample.finish_reason == "length" or len(sample.response_ids) > room:
            self.finish = "length"

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)

    def sample(self) -> RolloutSample:
        routes = None
        if self.last is not None and self.last.routed_experts is not None:
            routes = self.last.routed_experts[: len(self.prompt_ids) + len(self.response_ids) - 1]
        version = self.last.weight_version if self.last is not None else 0
        return RolloutSample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish or "length",  # type: ignore[arg-type]
            weight_version=self.versions[-1] if self.versions else version,
            routed_experts=routes,
            token_versions=list(self.versions) if len(set(self.versions)) > 1 else None,
            loss_mask=self.mask,
            episode=self.record,
        )


@dataclass
class _Failures:
    """The failed environment calls of one batch of episodes (rank 0), for one warning."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENV_FAILURES, 0))
    first: str | None = None

    def add(self, status: str, error: str) -> None:
        self.counts[status] += 1
        if self.first is None:
            self.first = error


class _Rank0:
    """Rank 0's side of one batch of episodes: their environments, called as each episode
    needs, and the answers, converted to what every rank appends."""

    def __init__(self, runner: EpisodeRunner, prompts: Sequence[Prompt]) -> None:
        self.runner = runner
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.envs: dict[int, Any] = {}
        self.failures = _Failures()
        self.waited_s = 0.0  # blocked for an answer with no model turn to run
        self.out = 0  # calls not answered yet
        for i, p in enumerate(prompts):
            self._call(i, "reset", (None, "reset", (p.prompt, p.label)))

    def step(self, i: int, episode: _Episode, stop_ids: Sequence[int]) -> None:
        text = self.runner._turn_text(episode, stop_ids)
        self._call(i, "step", (self.envs.get(i), "step", (text,)))

    def _call(self, i: int, kind: str, call: tuple) -> None:
        self.out += 1
        future = self.runner.calls.submit(call)
        future.add_done_callback(lambda f: self.answers.put(("env", i, kind, f.result())))

    def take(self, block: bool, window_s: float = 0.0) -> list[tuple]:
        """The answers that have arrived, converted. `block`: wait for the first one, then for
        more while calls are out, until `window_s` after it: a round costs about as much for
        one episode as for many, so answers that arrive within about one round's time go
        together instead of each starting a round of its own."""
        items = []
        started = time.perf_counter()
        if block:
            items.append(self.answers.get())
            self.out -= 1
            deadline = time.perf_counter() + window_s
            while self.out > 0 and (left := deadline - time.perf_counter()) > 0:
                try:
                    items.append(self.answers.get(timeout=left))
                except queue.Empty:
                    break
                self.out -= 1
            self.waited_s += time.perf_counter() - started
        while True:
            try:
                items.append(self.answers.get_nowait())
            except queue.Empty:
                return [self.convert(item) for item in items]
            self.out -= 1

    def convert(self, item: tuple) -> tuple:
        """("env", i, kind, CallOutcome) -> (i, kind, what every rank appends)."""
        _, i, kind, outcome = item
        return i, kind, self._answer(i, kind, outcome)

    def _answer(self, i: int, kind: str, outcome: CallOutcome) -> Any:
        if outcome.status != "ok":
            self.failures.add(outcome.status, f"{kind}: {outcome.error}")
            return EpisodeRecord(failure=outcome.status)
        self.envs[i], value = outcome.value
        try:
            if kind == "reset":
                return self.runner._context_ids(value)
            return self.runner._observation_ids(value)
        except EnvironmentContractError as e:
            self.failures.add("malformed", str(e))
            return EpisodeRecord(failure="malformed")

    def report(self, episodes: int) -> None:
        f = self.failures
        if f.first is None:
            return
        logger.warning(
            "environment %s: %d of %d episodes ended by a failed call (%d raised, %d timed out, "
            "%d malformed answers); first: %s",
            self.runner._env_name, sum(f.counts.values()), episodes, f.counts["error"],
            f.counts["timeout"], f.counts["malformed"], f.first,
        )  # fmt: skip


class EpisodeRunner:
    """Runs episodes of `env` through a RolloutDriver (see the module docstring)."""

    def __init__(self, cfg: EnvConfig, tokenizer, ranks: Ranks, max_sequence_length: int) -> None:
        cfg.validate()
        self.cfg = cfg
        self.ranks = ranks
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer)
        self.max_sequence_length = max_sequence_length
        cls = environment_class(cfg.name)
        self._env_name = cfg.name
        executor = cfg.executor
        if executor == "auto":
            executor = "inline" if cls.inline_safe else _process_or_thread(cls)
        factory = (cls, dict(cfg.kwargs))
        self.calls = None
        if ranks.rank == 0:
            self.calls = EnvCalls(executor, cfg.timeout_s, factory, workers=cfg.workers)
        self._env_time_s = 0.0  # rank 0's time waiting for environments with nothing to run
        self._running: set[threading.Event] = set()  # the cancel flags of batches in threads
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the batches running in threads and the environments' worker processes."""
        self.cancel()
        if self.calls is not None:
            self.calls.close()

    def cancel(self) -> None:
        """Stop every batch running in a thread (its future fails with CancelledError)."""
        with self._lock:
            for flag in self._running:
                flag.set()

    def take_env_time(self) -> float:
        """Seconds rank 0 waited for environments with no model turn to run, since the last
        call of this."""
        with self._lock:
            spent, self._env_time_s = self._env_time_s, 0.0
        return spent

    def run(
        self,
        rollouts: RolloutDriver,
        prompts: Sequence[Prompt],
        n: int,
        params: SamplingParams,
        *,
        min_version: int | None = None,
        urgent: bool = False,
    ) -> list[list[RolloutSample]]:
        """`n` episodes per prompt, grouped per prompt in prompt order, on every rank.
        `min_version` / `urgent`: an engine outside the trainer's (see `submit`)."""
        engine = getattr(rollouts, "engine", None)
        if engine is not None and not engine.generates_on_every_rank:
            submitted = self.submit(
                rollouts, prompts, n, params, min_version=min_version, urgent=urgent
            )
            return rollouts.collect(submitted)
        return self._run_rounds(rollouts, [p for p in prompts for _ in range(n)], n, params)

    def submit(
        self,
        rollouts: RolloutDriver,
        prompts: Sequence[Prompt],
        n: int,
        params: SamplingParams,
        *,
        min_version: int | None = None,
        urgent: bool = False,
    ) -> Submitted:
        """Start `n` episodes per prompt on an engine outside the trainer, in a thread of rank 0
        (every rank calls this; `rollouts.collect` waits for them on every rank). Every turn is
        a job of the engine started with weights of version >= `min_version`; `urgent` turns go
        before queued jobs. The future holds the turns' summed `JobStats` as `job_stats`."""
        if self.ranks.rank != 0:
            return Submitted(None)
        flat = [p for p in prompts for _ in range(n)]
        future: concurrent.futures.Future = concurrent.futures.Future()
        cancelled = threading.Event()
        future.cancel_episodes = cancelled.set  # type: ignore[attr-defined]
        # the driver cancels the future of a batch it gives up on: its episodes stop too
        future.add_done_callback(lambda f: cancelled.set() if f.cancelled() else None)
        with self._lock:
            self._running.add(cancelled)

        def body() -> None:
            stats = JobStats()
            try:
                episodes = self._run_jobs(
                    rollouts.engine, flat, params, min_version, urgent, cancelled, stats
                )
                future.job_stats = stats  # type: ignore[attr-defined]
                if not future.cancelled():
                    future.set_result(_grouped(episodes, n))
            except BaseException as e:  # noqa: BLE001 - the driver raises it on every rank
                if not future.cancelled():
                    future.set_exception(e)
            finally:
                with self._lock:
                    self._running.discard(cancelled)

        threading.Thread(target=body, name="episodes", daemon=True).start()
        return Submitted(future)

    # -- an engine on every rank: rounds decided by rank 0 -----------------------------------

    def _run_rounds(
        self, rollouts, flat: Sequence[Prompt], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        episodes = [_Episode(list(p.prompt_ids)) for p in flat]
        rank0 = _Rank0(self, flat) if self.ranks.rank == 0 else None
        round_s = 0.0  # how long the last round generated
        try:
            for round_ in itertools.count():
                if all(e.finish is not None for e in episodes):
                    break
                answers = None
                if rank0 is not None:
                    answers = rank0.take(not any(e.due for e in episodes), round_s)
                for i, kind, answer in self.ranks.broadcast(answers):
                    self._answered(episodes[i], kind, answer)
                batch = self._due(episodes)
                if not batch:
                    continue
                contexts = [episodes[i].context() for i, _ in batch]
                started = time.perf_counter()
                groups = rollouts.generate(contexts, 1, _turn_params(params, round_))
                round_s = time.perf_counter() - started
                for (i, room), (sample,) in zip(batch, groups, strict=True):
                    episodes[i].add_turn(sample, room)
                    if rank0 is not None and episodes[i].finish is None:
                        rank0.step(i, episodes[i], params.stop_token_ids)
        finally:
            if rank0 is not None:
                self._done(rank0, len(episodes))
        return _grouped(episodes, n)

    # -- an engine outside the trainer: rank 0's thread, one job per turn batch -----------------

    def _run_jobs(
        self,
        engine,
        flat: Sequence[Prompt],
        params: SamplingParams,
        min_version: int | None,
        urgent: bool,
        cancelled: threading.Event,
        stats: JobStats,
    ) -> list[_Episode]:
        episodes = [_Episode(list(p.prompt_ids)) for p in flat]
        rank0 = _Rank0(self, flat)
        one_at_a_time = getattr(engine, "runs_one_job_at_a_time", False)
        in_flight: dict[int, list[tuple[int, int]]] = {}  # job -> (episode, room) of its turns
        jobs = itertools.count()
        try:
            while not all(e.finish is not None for e in episodes):
                if cancelled.is_set():
                    raise concurrent.futures.CancelledError("the episodes were abandoned")
                turns = sum(len(t) for t in in_flight.values())
                if not (one_at_a_time and in_flight):
                    batch = self._due(episodes, self.cfg.max_concurrent_turns - turns)
                    if batch:
                        job = next(jobs)
                        contexts = [episodes[i].context() for i, _ in batch]
                        future = engine.start_generate(
                            contexts, 1, _turn_params(params, job),
                            min_version=min_version, urgent=urgent,
                        )  # fmt: skip
                        in_flight[job] = batch
                        future.add_done_callback(
                            lambda f, job=job: rank0.answers.put(("turn", job, f))
                        )
                        continue
                if all(e.finish is not None for e in episodes):
                    break
                item = None
                waiting_on_env = not in_flight
                started = time.perf_counter()
                try:
                    item = rank0.answers.get(timeout=0.5)
                except queue.Empty:
                    continue
                finally:
                    if waiting_on_env:
                        rank0.waited_s += time.perf_counter() - started
                if item[0] == "env":
                    rank0.out -= 1
                    self._answered(episodes[item[1]], *rank0.convert(item)[1:])
                    continue
                _, job, future = item
                groups = future.result()  # an engine's failure fails the batch
                _add_stats(stats, getattr(future, "job_stats", None))
                for (i, room), (sample,) in zip(in_flight.pop(job), groups, strict=True):
                    episodes[i].add_turn(sample, room)
                    if episodes[i].finish is None:
                        rank0.step(i, episodes[i], params.stop_token_ids)
        finally:
            self._done(rank0, len(episodes))
        return episodes

    # -- shared ------------------------------------------------------------------------------

    def _due(self, episodes: list[_Episode], limit: int | None = None) -> list[tuple[int, int]]:
        """(episode, room) of the episodes due a model turn, in episode order, at most `limit`;
        one without room left ends with finish reason "length"."""
        limit = len(episodes) if limit is None else limit
        batch = []
        for i, e in enumerate(episodes):
            if not e.due or len(batch) >= limit:
                continue
            room = e.room(self.cfg.max_tokens, self.max_sequence_length)
            e.due = False
            if room < 1:
                e.finish = "length"
            else:
                batch.append((i, room))
        return batch

    def _answered(self, e: _Episode, kind: str, answer: Any) -> None:
        """Append an environment's answer (the same on every rank); the episode is then due a
        model turn unless it is over."""
        if isinstance(answer, EpisodeRecord):  # the call failed: the episode ends here
            answer.turns, answer.answer_start = e.record.turns, e.record.answer_start
            answer.tool_calls, answer.tool_errors = e.record.tool_calls, e.record.tool_errors
            e.record = answer
            e.finish = "abort" if kind == "reset" else "stop"
            return
        if kind == "reset":
            if answer is not None:
                e.prompt_ids = answer
        else:
            self._apply(e, answer, last_turn=e.record.turns >= self.cfg.max_turns)
        e.due = e.finish is None

    def _done(self, rank0: _Rank0, episodes: int) -> None:
        rank0.report(episodes)
        with self._lock:
            self._env_time_s += rank0.waited_s

    def _context_ids(self, context: Any) -> list[int] | None:
        where = f"environment {self._env_name!r}.reset"
        check_observation(context, where, messages=False)
        if context is None:
            return None
        ids = self.chat.user_ids(context) if isinstance(context, str) else list(context)
        if not ids:
            raise EnvironmentContractError(f"{where} returned an empty initial context")
        return ids

    def _turn_text(self, episode: _Episode, stop_ids: Sequence[int]) -> str:
        turn = episode.response_ids[episode.record.answer_start :]
        if turn and turn[-1] in stop_ids:
            turn = turn[:-1]
        return self.tokenizer.decode(turn, skip_special_tokens=False)

    def _observation_ids(self, result: Any) -> tuple[list[int], StepResult]:
        where = f"environment {self._env_name!r}.step"
        result = check_step_result(result, where)
        if not math.isfinite(float(result.reward)):
            raise EnvironmentContractError(
                f"{where} returned a non-finite reward {result.reward!r}"
            )
        observation = result.observation
        if observation is None or result.done:
            ids = []
        elif isinstance(observation, str):
            ids = self.chat.message_ids([observation], result.role)
        elif observation and isinstance(observation[0], str):
            ids = self.chat.message_ids(list(observation), result.role)
        else:
            ids = list(observation)
        return ids, dataclasses.replace(result, observation=None)

    def _apply(self, e: _Episode, answer: tuple[list[int], StepResult], last_turn: bool) -> None:
        ids, result = answer
        record = e.record
        record.tool_calls += result.tool_calls
        record.tool_errors += result.tool_errors
        record.env_reward += float(result.reward)  # the episode's step rewards, summed here
        record.turn_rewards.append((record.answer_start, float(result.reward)))
        if result.done:
            e.finish = "stop"
        elif result.tool_errors and self.cfg.on_tool_error == "end":
            record.failure, e.finish = "tool_error", "stop"
        elif last_turn:
            e.finish = "length"
        elif len(ids) >= e.room(self.cfg.max_tokens, self.max_sequence_length):
            # the observation and at least one model token must fit
            record.truncated_observation, e.finish = True, "length"
        else:
            e.add_observation(ids)


def _grouped(episodes: list[_Episode], n: int) -> list[list[RolloutSample]]:
    return [[e.sample() for e in episodes[p : p + n]] for p in range(0, len(episodes), n)]


def _add_stats(total: JobStats, job: JobStats | None) -> None:
    if job is None:
        return
    total.idle_s += job.idle_s
    total.weights_wait_s += job.weights_wait_s
    total.generate_s += job.generate_s
    total.weight_swaps += job.weight_swaps
    total.sampled_tokens += job.sampled_tokens


def _process_or_thread(cls: type) -> str:
    """Worker processes when the class can reach them (importable by reference), else threads."""
    try:
        pickle.loads(pickle.dumps(cls))
    except Exception as e:  # noqa: BLE001 - any reason it cannot travel
        logger.warning(
            "environment %s cannot run in worker processes (%s); env.executor=thread "
            "(a hung call is abandoned, not killed)", cls.__qualname__, e,
        )  # fmt: skip
        return "thread"
    return "process"


def _turn_params(params: SamplingParams, turn: int) -> SamplingParams:
    """Turn `turn`'s sampling: its own seed (turn 0 keeps the step's)."""
    if params.seed is None or turn == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed * 1_000_003 + turn * 7919) % (2**31 - 1))


def episode_rewards(
    rewards: torch.Tensor, flat: Sequence[RolloutSample]
) -> tuple[torch.Tensor, int]:
    """Each episode's reward: the reward section's score of its final answer plus the
    environment's step rewards; 0 for an episode whose environment failed (counted with the
    failed rewards: ENV_FAILURES) or that a failed tool call ended (env.on_tool_error=end)."""
    failures = [s.episode.failure for s in flat]
    zero = torch.tensor([f is not None for f in failures]).view_as(rewards)
    extra = torch.tensor([s.episode.env_reward for s in flat], dtype=rewards.dtype)
    total = torch.where(zero, 0.0, rewards + extra.view_as(rewards))
    return total, sum(f in ENV_FAILURES for f in failures)
