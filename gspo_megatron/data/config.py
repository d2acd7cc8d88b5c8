"""The `data` config group and the one function that turns it into data sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gspo_megatron.config_fields import bounded, choice, raise_on_problems
from gspo_megatron.data.dataset import PromptDataset, load_prompt_dataset
from gspo_megatron.data.synthetic import synthetic_prompt_dataset
from gspo_megatron.rewards.synthetic import SYNTHETIC_TASKS, SyntheticTask, make_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# The keys that say how a prompt file is read (the rest are about which prompts to train on).
READING_KEYS = (
    "format",
    "prompt_key",
    "label_key",
    "apply_chat_template",
    "system_prompt",
    "max_prompt_length",
    "on_error",
)


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

    def validate(self, *, for_training: bool = True) -> None:
        """for_training: training prompts are needed (gspo-eval needs none)."""
        raise_on_problems(self, "data")
        both = bool(self.train_files) and self.task is not None
        neither = not self.train_files and self.task is None
        if both or (for_training and neither):
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


def build_heldout_dataset(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase
) -> PromptDataset | None:
    """The held-out prompts (data.eval_files, or the synthetic task's held-out split), or None."""
    if cfg.task is not None:
        if not cfg.num_eval:
            return None
        return synthetic_prompt_dataset(
            tokenizer, cfg.task, cfg.num_eval, split="eval", **_synthetic(cfg)
        )
    return load_files(cfg, cfg.eval_files, tokenizer) if cfg.eval_files else None


def _task_kwargs(cfg: DataConfig) -> dict[str, Any]:
    kwargs: Any = cfg.task_kwargs
    if not isinstance(kwargs, dict):  # an OmegaConf DictConfig
        from omegaconf import OmegaConf

        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    return kwargs


def synthetic_task(cfg: DataConfig) -> SyntheticTask:
    """The synthetic task `data.task` with `data.task_kwargs`."""
    return make_task(cfg.task, **_task_kwargs(cfg))


def _synthetic(cfg: DataConfig) -> dict[str, Any]:
    return dict(
        seed=cfg.seed,
        heldout_fraction=cfg.heldout_fraction,
        max_prompt_length=cfg.max_prompt_length,
        **_task_kwargs(cfg),
    )


def load_files(
    cfg: DataConfig, files: list[str], tokenizer: PreTrainedTokenizerBase
) -> PromptDataset:
    """Prompts from JSONL / Parquet files, read as `cfg` says (its READING_KEYS)."""
    return load_prompt_dataset(
        list(files), tokenizer, **{key: getattr(cfg, key) for key in READING_KEYS}
    )


def build_datasets(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, eval) data sets for a data config; eval is None when none is configured."""
    cfg.validate()
    if cfg.task is not None:
        train = synthetic_prompt_dataset(
            tokenizer, cfg.task, cfg.num_train, split="train", **_synthetic(cfg)
        )
    else:
        train = load_files(cfg, cfg.train_files, tokenizer)
    return train, build_heldout_dataset(cfg, tokenizer)
