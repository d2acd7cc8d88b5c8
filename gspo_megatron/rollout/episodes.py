"""Multi-turn episodes: a model turn, the environment's answer, the next model turn, ...

Every rank runs `EpisodeRunner.run` with the same arguments. Each turn generates for all live
episodes at once through the rollout driver (one batch for the embedded engine; concurrent
`/generate` requests with `input_ids` for SGLang), so episodes advance turn by turn together
and finished ones drop out. Environments live on rank 0, which steps them and shares what they
answered; every rank then appends the same tokens.

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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pickle
import time
from collections.abc import Callable, Sequence
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
from gspo_megatron.rollout.base import EpisodeRecord, RolloutSample, SamplingParams

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from gspo_megatron.data.dataset import Prompt
    from gspo_megatron.envs.registry import EnvConfig
    from gspo_megatron.ranks import Ranks
    from gspo_megatron.rollout.driver import RolloutDriver


@dataclass
class _Episode:
    prompt_ids: list[int]
    env: Any = None  # on rank 0: the environment (pickled with env.executor=process)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish: str | None = None  # set when the episode is over
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
        self.last = sample
        if sample.finish_reason == "abort":
            self.finish = "abort"
        elif sample.finish_reason == "length" or len(sample.response_ids) > room:
            self.finish = "length"

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def sample(self) -> RolloutSample:
        routes = None
        if self.last is not None and self.last.routed_experts is not None:
            routes = self.last.routed_experts[: len(self.prompt_ids) + len(self.response_ids) - 1]
        return RolloutSample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish or "length",  # type: ignore[arg-type]
            weight_version=self.last.weight_version if self.last is not None else 0,
            routed_experts=routes,
            loss_mask=self.mask,
            episode=self.record,
        )


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
        self._env_time_s = 0.0  # rank 0's time in environment calls

    def close(self) -> None:
        """Stop the environments' worker processes."""
        if self.calls is not None:
            self.calls.close()

    def take_env_time(self) -> float:
        """Seconds rank 0 spent in environment calls since the last call of this."""
        spent, self._env_time_s = self._env_time_s, 0.0
        return spent

    def run(
        self,
        rollouts: RolloutDriver,
        prompts: Sequence[Prompt],
        n: int,
        params: SamplingParams,
    ) -> list[list[RolloutSample]]:
        """`n` episodes per prompt, grouped per prompt in prompt order, on every rank."""
        episodes = self._reset([p for p in prompts for _ in range(n)])
        for turn in range(self.cfg.max_turns):
            live: list[tuple[_Episode, int]] = []
            for e in episodes:
                if e.finish is None:
                    room = e.room(self.cfg.max_tokens, self.max_sequence_length)
                    if room < 1:
                        e.finish = "length"
                    else:
                        live.append((e, room))
            if not live:
                break
            contexts = [e.context() for e, _ in live]
            groups = rollouts.generate(contexts, 1, _turn_params(params, turn))
            for (e, room), (sample,) in zip(live, groups, strict=True):
                e.add_turn(sample, room)
            stepped = [e for e, _ in live if e.finish is None]
            last_turn = turn == self.cfg.max_turns - 1
            answers = self._step(stepped, params.stop_token_ids)
            for e, answer in zip(stepped, answers, strict=True):
                self._apply(e, answer, last_turn)
        return [[episodes[p * n + j].sample() for j in range(n)] for p in range(len(prompts))]

    # -- environment calls (rank 0), shared with every rank ---------------------------------

    def _reset(self, prompts: Sequence[Prompt]) -> list[_Episode]:
        """Build and reset one environment per episode (rank 0); every rank gets the initial
        contexts."""
        envs: list[Any] = [None] * len(prompts)

        def answer() -> list:
            outcomes = self.calls.run([(None, "reset", (p.prompt, p.label)) for p in prompts])
            out = []
            for i, outcome in enumerate(outcomes):
                if outcome.status != "ok":
                    out.append(_failed(outcome))
                    continue
                envs[i], context = outcome.value
                out.append(self._context_ids(context))
            return out

        episodes = []
        for p, env, context in zip(prompts, envs, self._on_rank0(answer), strict=True):
            if isinstance(context, EpisodeRecord):  # the environment failed
                episodes.append(_Episode(list(p.prompt_ids), finish="abort", record=context))
            else:
                ids = list(p.prompt_ids) if context is None else context
                episodes.append(_Episode(ids, env=env))
        return episodes

    def _context_ids(self, context: Any) -> list[int] | None:
        where = f"environment {self._env_name!r}.reset"
        check_observation(context, where, messages=False)
        if context is None:
            return None
        ids = self.chat.user_ids(context) if isinstance(context, str) else list(context)
        if not ids:
            raise EnvironmentContractError(f"{where} returned an empty initial context")
        return ids

    def _step(self, episodes: Sequence[_Episode], stop_ids: Sequence[int]) -> list[Any]:
        """Per episode: (observation ids, StepResult) or an EpisodeRecord of the failure."""

        def answer() -> list:
            texts = [self._turn_text(e, stop_ids) for e in episodes]
            calls = [(e.env, "step", (text,)) for e, text in zip(episodes, texts, strict=True)]
            out = []
            for e, outcome in zip(episodes, self.calls.run(calls), strict=True):
                if outcome.status != "ok":
                    out.append(_failed(outcome))
                    continue
                e.env, result = outcome.value
                out.append(self._observation_ids(result))
            return out

        return self._on_rank0(answer)

    def _turn_text(self, episode: _Episode, stop_ids: Sequence[int]) -> str:
        turn = episode.response_ids[episode.record.answer_start :]
        if turn and turn[-1] in stop_ids:
            turn = turn[:-1]
        return self.tokenizer.decode(turn, skip_special_tokens=False)

    def _observation_ids(self, result: Any) -> tuple[list[int], StepResult] | EpisodeRecord:
        where = f"environment {self._env_name!r}.step"
        result = check_step_result(result, where)
        if not math.isfinite(float(result.reward)):
            logger.warning("%s returned a non-finite reward %r", where, result.reward)
            return EpisodeRecord(failure="error")
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

    def _on_rank0(self, compute: Callable[[], list]) -> list:
        """`compute()` on rank 0 (it calls the environments), shared with every rank; a broken
        environment contract stops every rank with rank 0's message."""
        answers = None
        if self.ranks.rank == 0:
            started = time.perf_counter()
            try:
                answers = compute()
            except EnvironmentContractError as e:
                answers = e
            self._env_time_s += time.perf_counter() - started
        answers = self.ranks.broadcast(answers)
        if isinstance(answers, EnvironmentContractError):
            raise answers
        return answers

    def _apply(self, e: _Episode, answer: Any, last_turn: bool) -> None:
        if isinstance(answer, EpisodeRecord):
            answer.turns, answer.answer_start = e.record.turns, e.record.answer_start
            answer.tool_calls, answer.tool_errors = e.record.tool_calls, e.record.tool_errors
            e.record, e.finish = answer, "stop"
            return
        ids, result = answer
        record = e.record
        record.tool_calls += result.tool_calls
        record.tool_errors += result.tool_errors
        record.env_reward += float(result.reward)
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


def _failed(outcome: CallOutcome) -> EpisodeRecord:
    return EpisodeRecord(failure=outcome.status)


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
    failed rewards) or that a failed tool call ended (env.on_tool_error=end)."""
    failures = [s.episode.failure for s in flat]
    zero = torch.tensor([f is not None for f in failures]).view_as(rewards)
    extra = torch.tensor([s.episode.env_reward for s in flat], dtype=rewards.dtype)
    total = torch.where(zero, 0.0, rewards + extra.view_as(rewards))
    return total, sum(f in ("error", "timeout") for f in failures)
