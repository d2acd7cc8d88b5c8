"""Benchmarks from the `eval` config, and running one: n responses per problem, scored by the
reward registry, reported as avg@n, pass@k, maj@k (evaluation/metrics.py) with one record per
problem. The training loop (`Trainer.evaluate`) and `gspo-eval` both run them through here,
generating through their `RolloutCollector` (collector.py).

Generation is collective (every rank calls `run_benchmark`, as it calls the rollout driver);
rewards are scored on rank 0 and broadcast, so every rank returns the same result.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gspo_megatron.config_fields import ConfigError
from gspo_megatron.data.dataset import DataError, Prompt, PromptDataset
from gspo_megatron.evaluation.config import BenchmarkConfig, benchmark_reading, benchmark_reward
from gspo_megatron.evaluation.metrics import benchmark_metrics
from gspo_megatron.files import write_atomically
from gspo_megatron.ranks import Ranks
from gspo_megatron.rewards.registry import build_scorer
from gspo_megatron.rewards.scorer import RewardScorer
from gspo_megatron.rollout.base import RolloutSample, SamplingParams

if TYPE_CHECKING:
    from gspo_megatron.config import RunConfig

SOLVED = 1.0  # a response solves its problem when it scores at least this


class Rollouts(Protocol):
    """What a benchmark generates through (collector.RolloutCollector)."""

    def groups(
        self, prompts: Sequence[Prompt], n: int, params: SamplingParams, *, now: bool = False
    ) -> list[list[RolloutSample]]:
        """`n` responses per problem, on every rank (`now`: with the current weights)."""
        ...

    def response_text(self, sample: RolloutSample) -> str:
        """What the reward reads of a response."""
        ...


@dataclass
class Benchmark:
    """A benchmark ready to run: its problems, sampling and scorer.

    answer: what a response's answer is, for maj@k (the reward's `answer` method); None when
    the reward cannot say, and maj@k is then not reported.
    """

    name: str
    problems: list[Prompt]
    settings: BenchmarkConfig
    params: SamplingParams
    scorer: RewardScorer
    owns_scorer: bool = False
    loading: dict[str, int] = field(default_factory=dict)

    @property
    def answer(self) -> Callable[[str], str | None] | None:
        return getattr(self.scorer.fn, "answer", None)

    def close(self) -> None:
        if self.owns_scorer:
            self.scorer.close()


@dataclass
class BenchmarkResult:
    name: str
    metrics: dict[str, float]
    records: list[dict[str, Any]]


def build_benchmarks(
    cfg: RunConfig,
    tokenizer,
    heldout: PromptDataset | None,
    scorer: RewardScorer,
    *,
    vocab_size: int,
    seed: int,
) -> list[Benchmark]:
    """The enabled benchmarks of cfg.eval: the held-out prompts (`heldout`, None when the data
    has none), then each named benchmark's files. Errors name the benchmark's key."""
    from gspo_megatron.data.vocab import check_prompt_ids
    from gspo_megatron.notes import note

    stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    out = []
    for name, bench in cfg.eval.named().items():
        key = "eval.heldout" if name == "heldout" else f"eval.benchmarks.{name}"
        if name == "heldout":
            if heldout is None or len(heldout) == 0:
                note(
                    "eval.heldout: the data have no held-out prompts (data.eval_files, or the "
                    "synthetic task's data.num_eval); it is not evaluated"
                )
                continue
            dataset, own, loading = heldout, scorer, {}
        else:
            dataset = _load(cfg, bench, key, tokenizer)
            loading = dataset.stats.as_dict()
            reward = benchmark_reward(cfg.reward, bench, key)
            own = scorer if reward is cfg.reward else build_scorer(reward)
        problems = list(dataset.prompts[: bench.problems])
        check_prompt_ids(PromptDataset(problems, source=dataset.source), vocab_size)
        max_new_tokens = bench.max_new_tokens or cfg.rollout.max_new_tokens
        longest = max(len(p.prompt_ids) for p in problems)
        if longest + max_new_tokens > cfg.engine.max_sequence_length:
            raise ConfigError(
                f"{key}: its longest prompt ({longest} tokens) plus max_new_tokens="
                f"{max_new_tokens} exceeds engine.max_sequence_length="
                f"{cfg.engine.max_sequence_length}"
            )
        params = SamplingParams(
            temperature=bench.temperature,
            top_p=bench.top_p,
            top_k=-1,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            seed=_benchmark_seed(seed, name),
        )
        out.append(
            Benchmark(
                name, problems, bench, params, own, owns_scorer=own is not scorer, loading=loading
            )  # fmt: skip
        )
    return out


def _benchmark_seed(seed: int, name: str) -> int:
    """A benchmark's sampling seed: the run's and its name's (adding another benchmark changes
    no other's samples); the held-out one keeps the seed the in-loop evaluation always had."""
    salt = 0 if name == "heldout" else zlib.crc32(name.encode())
    return (seed * 1_000_003 + salt * 104_729) % (2**31 - 1)


def _load(cfg: RunConfig, bench: BenchmarkConfig, key: str, tokenizer) -> PromptDataset:
    from gspo_megatron.data.config import load_files

    try:
        return load_files(benchmark_reading(cfg.data, bench, key), bench.files, tokenizer)
    except DataError as err:
        raise DataError(f"{key}: {err}") from err


def run_benchmark(
    bench: Benchmark,
    rollouts: Rollouts,
    ranks: Ranks,
    *,
    chunk_problems: int | None = None,
    progress: bool = False,
) -> BenchmarkResult:
    """Generate `samples` responses per problem with the current weights (`chunk_problems`
    problems per generate call, None = all at once), score them on rank 0, and return the
    metrics and the records."""
    n = bench.settings.samples
    size = chunk_problems or len(bench.problems)
    bar = None
    if progress and ranks.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(bench.problems), desc=bench.name, unit="problem", dynamic_ncols=True)
    records: list[dict[str, Any]] = []
    failures = 0
    try:
        for start in range(0, len(bench.problems), size):
            problems = bench.problems[start : start + size]
            groups = rollouts.groups(problems, n, bench.params, now=True)
            texts = [[rollouts.response_text(s) for s in group] for group in groups]
            scored = None
            if ranks.rank == 0:
                scored = _score(bench, problems, groups, texts)
            rewards, answers, failed = ranks.broadcast(scored)
            failures += failed
            for i, (problem, group) in enumerate(zip(problems, groups, strict=True)):
                records.append(
                    _record(problem, group, texts[i], rewards[i], answers and answers[i])
                )
            if bar is not None:
                bar.update(len(problems))
    finally:
        if bar is not None:
            bar.close()
    return BenchmarkResult(bench.name, _metrics(bench, records, failures), records)


def _score(
    bench: Benchmark,
    problems: Sequence[Prompt],
    groups: list[list[RolloutSample]],
    texts: list[list[str]],
) -> tuple[list[list[float]], list[list[str | None]] | None, int]:
    """Rewards [problem][sample] (an episode's: its answer's score plus the environment's
    step rewards), answers when the reward can say, and the failed reward calls."""
    import torch

    from gspo_megatron.rollout.episodes import episode_rewards

    flat = [t for group in texts for t in group]
    prompts = [p.prompt for p, group in zip(problems, texts, strict=True) for _ in group]
    labels = [p.label for p, group in zip(problems, texts, strict=True) for _ in group]
    batch = bench.scorer.score(prompts, flat, labels)
    failed = batch.num_failures + batch.num_timeouts
    rewards = torch.tensor(batch.rewards, dtype=torch.float32).view(len(groups), -1)
    samples = [s for group in groups for s in group]
    if samples and samples[0].episode is not None:
        rewards, env_failed = episode_rewards(rewards, samples)
        failed += env_failed
    answers = None
    if bench.answer is not None:
        answers = [[bench.answer(t) for t in group] for group in texts]
    return rewards.tolist(), answers, failed


def _record(
    problem: Prompt,
    group: Sequence[RolloutSample],
    texts: list[str],
    rewards: list[float],
    answers: list[str | None] | None,
) -> dict[str, Any]:
    record = {
        "index": problem.index,
        "prompt": problem.prompt,
        "label": problem.label,
        "responses": texts,
        "rewards": rewards,
        "solved": [int(r >= SOLVED) for r in rewards],
        "finish_reasons": [s.finish_reason for s in group],
        "response_tokens": [len(s.response_ids) for s in group],
    }
    if answers is not None:
        record["answers"] = answers
    return record


def _metrics(bench: Benchmark, records: list[dict[str, Any]], failures: int) -> dict[str, float]:
    solved = [r["solved"] for r in records]
    answers = [r["answers"] for r in records] if bench.answer is not None else None
    rewards = [x for r in records for x in r["rewards"]]
    lengths = [x for r in records for x in r["response_tokens"]]
    truncated = [f == "length" for r in records for f in r["finish_reasons"]]
    return benchmark_metrics(solved, bench.settings.pass_ks(), answers) | {
        "reward_mean": math.fsum(rewards) / len(rewards),
        "reward_failures": float(failures),
        "response_tokens_mean": sum(lengths) / len(lengths),
        "truncated_fraction": sum(truncated) / len(truncated),
        "problems": float(len(records)),
    }


def write_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """One JSON line per problem (a kill leaves the previous file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records]
    write_atomically(path, "".join(lines))
