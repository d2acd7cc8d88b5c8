"""The `eval` config group: the benchmarks a run (and `gspo-eval`) evaluates, each an instance
of one model, `BenchmarkConfig`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from gspo_megatron.config_fields import ConfigError, bounded, check_fields, raise_on_problems
from gspo_megatron.data.config import READING_KEYS, DataConfig
from gspo_megatron.rewards.registry import RewardConfig

# The reward section's keys a benchmark may change; a learned reward model never scores one.
REWARD_KEYS = ("name", "kwargs", "timeout_s", "max_concurrency", "executor")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass
class BenchmarkConfig:
    """One benchmark: its problems, how many responses each gets and how they are sampled.

    files: JSONL or Parquet files of problems. The held-out benchmark (`eval.heldout`) takes no
    files: its problems are the training data's held-out prompts (data.eval_files, or the
    synthetic task's held-out split).
    data: how the files are read, over the data section's values: any of format, prompt_key,
    label_key, apply_chat_template, system_prompt, max_prompt_length, on_error.
    problems: the first N problems (null = all, 0 = skip this benchmark).
    samples: responses per problem (n of avg@n; the GSPO paper's AIME'24 avg@32 is 32).
    ks: pass@k (and maj@k, when the reward can say what a response's answer is) at these k;
    empty = 1 and `samples`. Every k must be <= samples.
    temperature (0 = greedy), top_p, max_new_tokens (null = rollout.max_new_tokens).
    reward: how responses are scored, over the reward section's values: any of name, kwargs,
    timeout_s, max_concurrency, executor (a `name` of its own starts from empty kwargs). A
    response solves its problem when it scores >= 1.
    """

    files: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    problems: int | None = bounded(None, ge=0)
    samples: int = bounded(1, ge=1)
    ks: list[int] = field(default_factory=list)
    temperature: float = bounded(0.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    max_new_tokens: int | None = bounded(None, ge=1)
    reward: dict[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.problems != 0

    def pass_ks(self) -> list[int]:
        """The k of pass@k, ascending."""
        return sorted(set(self.ks) or {1, self.samples})

    def validate(self, key: str) -> None:
        raise_on_problems(self, key)
        for name, allowed in (("data", READING_KEYS), ("reward", REWARD_KEYS)):
            unknown = sorted(set(getattr(self, name)) - set(allowed))
            if unknown:
                raise ValueError(
                    f"{key}.{name}.{unknown[0]} cannot be set per benchmark; it takes "
                    f"{', '.join(allowed)}"
                )
        bad = [k for k in self.ks if isinstance(k, bool) or not isinstance(k, int) or k < 1]
        if bad:
            raise ValueError(f"{key}.ks: every k must be an integer >= 1, got {bad[0]!r}")
        too_large = [k for k in self.ks if k > self.samples]
        if too_large:
            raise ValueError(
                f"{key}.ks: k={too_large[0]} is larger than {key}.samples={self.samples}; "
                "pass@k and maj@k need at least k responses per problem"
            )


def _heldout() -> BenchmarkConfig:
    return BenchmarkConfig(problems=64)


@dataclass
class EvalConfig:
    """The `eval` group: what the training loop evaluates, and `gspo-eval` on a checkpoint.

    every: evaluate every N RL steps (0 = never) and after the last.
    heldout: the training task's held-out prompts, logged as eval/<metric> (eval/avg@n,
    eval/pass@k, eval/reward_mean); its `problems: 0` turns it off.
    benchmarks: named benchmark files, logged as eval/<name>/<metric>.
    save_responses: write every response with its reward, per problem, to
    eval/step_<N>/<name>.jsonl in the run directory.
    """

    every: int = bounded(10, ge=0)
    heldout: BenchmarkConfig = field(default_factory=_heldout)
    benchmarks: dict[str, BenchmarkConfig] = field(default_factory=dict)
    save_responses: bool = True

    def named(self) -> dict[str, BenchmarkConfig]:
        """Every enabled benchmark by name, the held-out one as "heldout"."""
        out = {"heldout": self.heldout} if self.heldout.enabled else {}
        return out | {name: b for name, b in self.benchmarks.items() if b.enabled}

    def validate(self) -> None:
        raise_on_problems(self, "eval")
        self.heldout.validate("eval.heldout")
        if self.heldout.files:
            raise ValueError(
                "eval.heldout.files: the held-out benchmark's problems are the training data's "
                "held-out prompts (data.eval_files or the synthetic task's); name other files "
                "as a benchmark of their own, eval.benchmarks.<name>.files"
            )
        for name, bench in self.benchmarks.items():
            key = f"eval.benchmarks.{name}"
            if not _NAME.fullmatch(name) or name == "heldout":
                raise ValueError(
                    f"{key}: a benchmark's name is letters, digits, '_', '.' and '-' (and not "
                    "'heldout'), since metric and file names carry it"
                )
            if not dataclasses.is_dataclass(bench):
                raise ValueError(f"{key} must be a mapping of benchmark settings")
            bench.validate(key)
            if not bench.files:
                raise ValueError(f"{key}.files: a named benchmark needs its JSONL/Parquet files")


def benchmark_reward(run_reward: RewardConfig, bench: BenchmarkConfig, key: str) -> RewardConfig:
    """The reward section a benchmark scores with: the run's, with the benchmark's `reward`
    keys over it and no learned reward model."""
    if not bench.reward:
        return run_reward
    values = {k: getattr(run_reward, k) for k in REWARD_KEYS} | bench.reward
    if "name" in bench.reward and "kwargs" not in bench.reward:
        values["kwargs"] = {}  # another reward does not take the run's reward's arguments
    reward = RewardConfig(**values)
    try:
        reward.validate()
    except ValueError as err:
        raise ConfigError(str(err).replace("reward.", f"{key}.reward.")) from err
    return reward


def benchmark_reading(data: DataConfig, bench: BenchmarkConfig, key: str) -> DataConfig:
    """How a benchmark's files are read: the data section with the benchmark's `data` keys over
    it. A benchmark's rows must all be scored, so a bad row stops loading unless its own
    data.on_error says skip; and it needs labels."""
    values = {"on_error": "raise"} | bench.data
    try:
        reading = dataclasses.replace(data, **values)
    except TypeError as err:
        raise ConfigError(f"{key}.data: {err}") from err
    problems = check_fields(reading, f"{key}.data")
    if problems:
        raise ConfigError(problems[0])
    if reading.label_key is None:
        raise ConfigError(
            f"{key}.data.label_key is null: a benchmark's problems need labels to be scored"
        )
    return reading
