"""The `data` config group and the one function that turns it into data sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gspo_megatron.config_fields import bounded, choice, raise_on_problems
from gspo_megatron.data.dataset import PromptDataset, load_prompt_dataset
from gspo_megatron.data.synthetic import synthetic_prompt_dataset
from gspo_megatron.rewards.synthetic import SYNTHETIC_TASKS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class DataConfig:
    """Prompt data: files, or a synthetic task.

    train_files / eval_files: JSONL or Parquet files (eval optional). Leave empty to use `task`.
    format: auto (by file extension) | jsonl | parquet.
    prompt_key / label_key: field names; dotted names reach into nested objects
        ("reward_model.ground_truth"); label_key null for none.
    apply_chat_template: null = only for chat-message prompts; true = also wrap text prompts
        as a user message; false = never (chat-message prompts are then an error).
    system_prompt: a system message put first when a chat template is applied.
    max_prompt_length: prompts with more tokens are dropped and counted.
    on_error: skip | raise, for malformed lines and missing fields.
    task / task_kwargs: synthetic task (copy, reverse, sort, add) and its knobs
        (min_digits, max_digits, reverse_answer for add).
    num_train / num_eval / heldout_fraction: synthetic set sizes; held-out instances are
        disjoint from training ones.
    seed: synthetic generation and shuffling seed.
    shuffle: reshuffle every epoch (from seed and epoch) or walk in file order.
    """

    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    format: str = choice("auto", "jsonl", "parquet")
    prompt_key: str = "prompt"
    label_key: str | None = "label"
    apply_chat_template: bool | None = None
    system_prompt: str | None = None
    max_prompt_length: int = bounded(512, ge=1)
    on_error: str = choice("skip", "raise")
    task: str | None = None
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    num_train: int = bounded(10_000, ge=1)
    num_eval: int = bounded(256, ge=0)
    heldout_fraction: float = bounded(0.1, gt=0, lt=1)
    seed: int = bounded(0, ge=0)
    shuffle: bool = True

    def validate(self) -> None:
        raise_on_problems(self, "data")
        if bool(self.train_files) == (self.task is not None):
            raise ValueError(
                "set exactly one of data.train_files (JSONL/Parquet) and data.task (synthetic: "
                f"{sorted(SYNTHETIC_TASKS)}); got train_files={list(self.train_files)} "
                f"task={self.task}"
            )
        if self.task is not None and self.task not in SYNTHETIC_TASKS:
            raise ValueError(
                f"unknown data.task={self.task!r}; choose one of {sorted(SYNTHETIC_TASKS)}"
            )
        if self.task is not None and self.eval_files:
            raise ValueError("data.eval_files cannot be combined with data.task; use num_eval")


def build_datasets(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, eval) data sets for a data config; eval is None when none is configured."""
    cfg.validate()
    if cfg.task is not None:
        kwargs: Any = cfg.task_kwargs
        if not isinstance(kwargs, dict):  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            kwargs = OmegaConf.to_container(kwargs, resolve=True)
        common = dict(
            seed=cfg.seed,
            heldout_fraction=cfg.heldout_fraction,
            max_prompt_length=cfg.max_prompt_length,
            **kwargs,
        )
        train = synthetic_prompt_dataset(
            tokenizer, cfg.task, cfg.num_train, split="train", **common
        )
        evals = None
        if cfg.num_eval:
            evals = synthetic_prompt_dataset(
                tokenizer, cfg.task, cfg.num_eval, split="eval", **common
            )
        return train, evals

    def load(files: list[str]) -> PromptDataset:
        return load_prompt_dataset(
            list(files),
            tokenizer,
            prompt_key=cfg.prompt_key,
            label_key=cfg.label_key,
            apply_chat_template=cfg.apply_chat_template,
            system_prompt=cfg.system_prompt,
            max_prompt_length=cfg.max_prompt_length,
            on_error=cfg.on_error,  # type: ignore[arg-type]
            format=cfg.format,  # type: ignore[arg-type]
        )

    return load(cfg.train_files), load(cfg.eval_files) if cfg.eval_files else None
