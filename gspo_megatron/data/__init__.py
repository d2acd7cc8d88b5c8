"""Prompt data: JSONL/Parquet data sets, synthetic task data sets, the character tokenizer, a
resumable sampler and vocabulary checks.

    from gspo_megatron.data import DataConfig, PromptSampler, build_datasets, load_tokenizer
    tokenizer = load_tokenizer("char")
    train, evals = build_datasets(DataConfig(task="reverse"), tokenizer)
    sampler = PromptSampler(train, batch_size=32, seed=0)

See docs/REWARDS_AND_DATA.md.
"""

from gspo_megatron.data.config import DataConfig, build_datasets
from gspo_megatron.data.dataset import (
    DataError,
    DataStats,
    Prompt,
    PromptDataset,
    load_prompt_dataset,
    prompts_from_records,
    write_jsonl,
    write_parquet,
)
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.data.synthetic import in_heldout, synthetic_prompt_dataset, synthetic_records
from gspo_megatron.data.tokenizer import build_char_tokenizer, load_tokenizer
from gspo_megatron.data.vocab import VocabMismatchError, check_prompt_ids, check_vocab

__all__ = [
    "DataConfig",
    "DataError",
    "DataStats",
    "Prompt",
    "PromptDataset",
    "PromptSampler",
    "VocabMismatchError",
    "build_char_tokenizer",
    "build_datasets",
    "check_prompt_ids",
    "check_vocab",
    "in_heldout",
    "load_prompt_dataset",
    "load_tokenizer",
    "prompts_from_records",
    "synthetic_prompt_dataset",
    "synthetic_records",
    "write_jsonl",
    "write_parquet",
]
