"""What every rollout engine shares: the two kinds of engine the trainer drives, and the data
they exchange with it.

An engine is one of two kinds (rollout/driver.py calls each as its kind needs):
  * `InProcessRolloutEngine`: generates in the trainer's own processes, collectively (every
    rank calls it with the same arguments and gets the same samples): the embedded engine.
  * `ServerRolloutEngine`: generates outside the trainer (SGLang servers, the generator process
    of rollout.mode one_step_off / async); rank 0 drives it and shares the samples, while every
    rank takes part in its weight updates (the weight source's collectives).
Token ids go in; per-sample token ids, log-probs of the sampled tokens and finish reasons come
out. Weights flow in through `update_weights` as a stream of Hugging Face-named tensors (see
`WeightSource`), so an engine never needs to know how the trainer shards its model. Which engine
a run uses is `rollout.engine`, looked up in rollout/backends.py.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

FinishReason = Literal["stop", "length", "abort"]


class RolloutUnavailableError(RuntimeError):
    """No rollout server could generate within the engine's recovery deadline: the step cannot
    complete (the trainer checkpoints the state before it and stops)."""


class WeightsNotLoadedError(RuntimeError):
    """A weight update reached no server. They generate nothing until a later update of the
    same version reaches them (the trainer re-syncs them before they generate)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one generate call (SGLang's names and conventions)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k, as in SGLang
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutSample:
    """One generated response.

    `logprobs[j]` is the log-probability of `response_ids[j]` under the distribution the engine
    actually sampled from. `routed_experts`, when the engine records routes, is int32
    [prompt_len + len(response_ids) - 1, num_moe_layers, top_k]: the experts chosen for every
    token the model consumed (SGLang's layout), for routing replay (R3).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    routed_experts: np.ndarray | None = field(default=None, repr=False)
    # The weight version that sampled each response token, when it can differ between tokens (a
    # partial rollout spans a weight update); None: every token's is `weight_version`.
    token_versions: list[int] | None = None
    # Multi-turn episodes (gspo_megatron/rollout/episodes.py): 1 on the tokens the model sampled,
    # 0 on observations (whose `logprobs` entries are 0 and mean nothing); None: all sampled.
    loss_mask: list[int] | None = None
    episode: EpisodeRecord | None = None

    def versions(self) -> list[int]:
        """The weight version of each response token."""
        if self.token_versions is not None:
            return self.token_versions
        return [self.weight_version] * len(self.response_ids)


def response_text(sample: RolloutSample, tokenizer, stop_token_ids: Sequence[int]) -> str:
    """What a reward sees: every generated token but the final stop token, so special tokens
    the policy emits count against it instead of vanishing from the text. Of an episode: its
    last model turn (the final answer)."""
    ids = sample.response_ids
    if sample.episode is not None:
        ids = ids[sample.episode.answer_start :]
    if sample.finish_reason == "stop" and ids and ids[-1] in stop_token_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class EpisodeRecord:
    """What happened in one multi-turn episode, for its reward and the `env/` metrics."""

    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0  # the environment's step rewards, summed
    # Per-turn credit (algorithm.credit=turn): (where the model turn starts in response_ids,
    # the environment's reward for it), one per stepped turn; empty once a failure replaced it.
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    # "error" / "timeout": an environment call raised or hung (the episode's reward is 0);
    # "tool_error": a failed tool call ended it (env.on_tool_error=end)
    failure: str | None = None
    truncated_observation: bool = False  # an observation did not fit the token budget
    answer_start: int = 0  # where the last model turn starts in response_ids (what is scored)


@dataclass
class JobStats:
    """What one generate job of an engine outside the trainer cost (the generator process, SGLang
    servers); its future holds it as `job_stats` once done."""

    idle_s: float = 0.0  # before it started, no job was running: the rollouts waited on the trainer
    weights_wait_s: float = 0.0  # waiting for weights new enough (the staleness bound)
    generate_s: float = 0.0
    weight_swaps: int = 0  # partial rollouts: weights taken between two tokens
    sampled_tokens: int = 0  # response tokens this job sampled (not those it was given)


@dataclass
class JobProgress:
    """What a generate job has produced so far, per prompt its `n` samples: each one complete
    (`done`), or partial: the response tokens so far (possibly none), each with its log-prob
    and the weight version that sampled it (`token_versions`).

    A checkpoint records the progress of the jobs in flight (`ServerRolloutEngine.snapshot`);
    `start_generate(..., progress=)` continues a job from it: the complete samples are
    returned as they are, the others go on from their tokens with the sampling streams they
    started with (the same seeds, at the same positions).
    """

    samples: list[list[RolloutSample]]
    done: list[list[bool]]

    @classmethod
    def finished(cls, groups: list[list[RolloutSample]]) -> JobProgress:
        return cls(groups, [[True] * len(g) for g in groups])

    @classmethod
    def empty(cls, prompts: Sequence[Sequence[int]], n: int) -> JobProgress:
        """Nothing generated yet."""
        samples = [
            [RolloutSample(list(p), [], [], "abort", token_versions=[]) for _ in range(n)]
            for p in prompts
        ]
        return cls(samples, [[False] * n for _ in prompts])

    @property
    def complete(self) -> bool:
        return all(all(row) for row in self.done)

    def tokens(self) -> int:
        """Response tokens generated so far (complete and partial samples)."""
        return sum(len(s.response_ids) for group in self.samples for s in group)


@runtime_checkable
class WeightSource(Protocol):
    """Hugging Face-named tensors of the current policy, produced in bounded buckets.

    Every rank of the trainer iterates the same buckets (collectives happen inside); only ranks
    where `is_sender()` is true hold the gathered tensors and talk to the engine.
    """

    def buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    def is_sender(self) -> bool: ...


@runtime_checkable
class InProcessRolloutEngine(Protocol):
    """An engine that generates in the trainer's processes: every rank calls every method, with
    the same arguments, and gets the same result (the embedded engine)."""

    generates_on_every_rank: Literal[True]

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        """`n` samples for each prompt, grouped per prompt in prompt order."""
        ...

    def update_weights(self, source: WeightSource | None, version: int) -> None:
        """Tag later samples with `version`; `source` is None when the engine shares the
        trainer's parameters in memory."""
        ...

    def release_kept_context(self) -> None:
        """Free what the engine keeps between generate calls (the trainer's rollouts of a step
        are over; the embedded engine's prefix cache)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counts since the last call, as rollout/* metrics (the same on every rank)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ServerRolloutEngine(Protocol):
    """An engine that generates outside the trainer (servers, a process of its own). Rank 0
    starts and waits for its generate jobs (rollout/driver.py), polling every `resync_poll_s`
    for servers that need the weights again; every rank calls `update_weights` (the weight
    source's collectives), the other ranks' engines only drive those."""

    generates_on_every_rank: Literal[False]

    @property
    def resync_poll_s(self) -> float: ...

    def start_generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        min_version: int | None = None,
        urgent: bool = False,
        progress: JobProgress | None = None,
    ) -> concurrent.futures.Future:
        """A generate job: its future gives `n` samples per prompt, grouped per prompt, and then
        holds the job's `JobStats` as `job_stats`. It starts with weights of version >=
        `min_version` (default: the latest); `urgent` jobs go before queued ones. `progress`
        (a checkpoint's, from `snapshot`): continue those samples instead of starting over."""
        ...

    def snapshot(self, jobs: Sequence[concurrent.futures.Future]) -> list[JobProgress]:
        """The progress of each of `jobs` (futures of `start_generate`), for a checkpoint.

        Every token a sample has when the snapshot is taken is in it, and the jobs go on from
        exactly that state, as a run resumed from the checkpoint does (`progress=`). An engine
        whose jobs keep one weight version throughout (rollout.mode one_step_off, pinned
        versions) first finishes a job running with weights older than the latest published:
        the resumed run no longer has them.
        """
        ...

    def servers_to_resync(self) -> list[str]:
        """Servers (by URL) that are due for the whole current weights, on rank 0."""
        ...

    def update_weights(
        self, source: WeightSource | None, version: int, urls: Sequence[str] | None = None
    ) -> None:
        """The source's weights as `version`, to every server (or to `urls` alone: a re-sync).
        A failure that leaves servers without them raises `WeightsNotLoadedError`."""
        ...

    def fault_metrics(self) -> dict[str, float]:
        """Counts of faults since the last call, as rollout/* metrics (rank 0's)."""
        ...

    def close(self) -> None: ...


RolloutEngine = InProcessRolloutEngine | ServerRolloutEngine
