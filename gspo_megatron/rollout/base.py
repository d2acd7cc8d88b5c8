"""The rollout engine interface shared by the embedded engine and the SGLang engine.

The trainer talks to every engine through `RolloutEngine`; token ids go in, per-sample token ids,
log-probs of the sampled tokens and finish reasons come out. Weights flow in through
`update_weights` as a stream of Hugging Face-named tensors (see `WeightSource`), so an engine never
needs to know how the trainer shards its model.
"""

from __future__ import annotations

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


@runtime_checkable
class WeightSource(Protocol):
    """Hugging Face-named tensors of the current policy, produced in bounded buckets.

    Every rank of the trainer iterates the same buckets (collectives happen inside); only ranks
    where `is_sender()` is true hold the gathered tensors and talk to the engine.
    """

    def buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    def is_sender(self) -> bool: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine.

    `generates_on_every_rank`: true for engines whose generation is collective over the
    trainer's ranks (the embedded engine); false for engines outside the trainer (SGLang
    servers, the generator process), driven by rank 0 (the trainer shares the samples), which
    also offer `start_generate`, `servers_to_resync`, `update_weights(..., urls=)`,
    `resync_poll_s` and `fault_metrics` (gspo_megatron/rollout/driver.py,
    gspo_megatron/rollout/sglang/engine.py, gspo_megatron/rollout/embedded/generator.py).
    """

    generates_on_every_rank: bool

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        """`n` samples for each prompt, grouped per prompt in prompt order."""
        ...

    def update_weights(self, source: WeightSource | None, version: int) -> None:
        """Load new policy weights and tag subsequent samples with `version`.

        `source` is None for engines that share the trainer's parameters in memory.
        """
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> None: ...

    def health(self) -> bool: ...

    def close(self) -> None: ...
