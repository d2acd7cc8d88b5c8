"""Synthetic task data sets, generated deterministically from a seed.

    records = synthetic_records("reverse", 1000, seed=0, split="train", max_digits=6)
    ds = synthetic_prompt_dataset(tokenizer, "reverse", 1000, seed=0, split="train")

Train and held-out instances are disjoint by construction: an instance belongs to the held-out
split when a hash of (task name, prompt) falls below `heldout_fraction`, whatever the seed or
size. Each split draws from its own random stream (seeded by seed, split and task), so the same
arguments always give the same records on any machine.

Command line (writes JSONL with "prompt" and "label" fields):

    python -m gspo_megatron.data.synthetic --task add --num 2000 --split train --out train.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import random
from typing import TYPE_CHECKING, Any, Literal

from gspo_megatron.data.dataset import DataError, PromptDataset, prompts_from_records, write_jsonl
from gspo_megatron.rewards.synthetic import SYNTHETIC_TASKS, SyntheticTask, make_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Split = Literal["train", "eval"]


def in_heldout(task: SyntheticTask, prompt: str, heldout_fraction: float) -> bool:
    """Whether this instance belongs to the held-out split (a pure function of the instance)."""
    digest = hashlib.blake2b(f"{task.name}|{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < heldout_fraction


def synthetic_records(
    task: SyntheticTask | str,
    num: int,
    *,
    seed: int = 0,
    split: Split = "train",
    heldout_fraction: float = 0.1,
    **task_kwargs: Any,
) -> list[dict[str, str]]:
    """`num` records {"prompt", "label"} of one split; repeats within a split are possible."""
    if isinstance(task, str):
        task = make_task(task, **task_kwargs)
    elif task_kwargs:
        raise ValueError("task_kwargs apply only when the task is given by name")
    if split not in ("train", "eval"):
        raise DataError(f"synthetic split must be 'train' or 'eval', got {split!r}")
    if not 0 < heldout_fraction < 1:
        raise DataError(f"data.heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if num < 1:
        raise DataError(f"synthetic data set size must be >= 1, got {num}")
    rng = random.Random(f"gspo-synthetic|{task.name}|{split}|{seed}")
    want_heldout = split == "eval"
    records: list[dict[str, str]] = []
    attempts = 0
    max_attempts = 200 * num + 10_000
    while len(records) < num:
        attempts += 1
        if attempts > max_attempts:
            raise DataError(
                f"synthetic task {task!r}: drew only {len(records)} of {num} {split} instances "
                f"in {max_attempts} tries; the instance space is too small for "
                f"heldout_fraction={heldout_fraction}: raise max_digits or heldout_fraction"
            )
        prompt, target = task.sample(rng)
        if in_heldout(task, prompt, heldout_fraction) == want_heldout:
            records.append({"prompt": prompt, "label": target})
    return records


def synthetic_prompt_dataset(
    tokenizer: PreTrainedTokenizerBase,
    task: SyntheticTask | str,
    num: int,
    *,
    seed: int = 0,
    split: Split = "train",
    heldout_fraction: float = 0.1,
    max_prompt_length: int | None = None,
    **task_kwargs: Any,
) -> PromptDataset:
    """A tokenized synthetic data set (labels are the target strings)."""
    records = synthetic_records(
        task, num, seed=seed, split=split, heldout_fraction=heldout_fraction, **task_kwargs
    )
    name = task if isinstance(task, str) else task.name
    source = f"synthetic:{name}:{split}"
    rows = ((f"{source}:{i}", r) for i, r in enumerate(records))
    return prompts_from_records(
        rows, tokenizer, max_prompt_length=max_prompt_length, on_error="raise", source=source
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic task data set as JSONL.")
    parser.add_argument("--task", required=True, choices=sorted(SYNTHETIC_TASKS))
    parser.add_argument("--num", type=int, required=True)
    parser.add_argument("--split", default="train", choices=["train", "eval"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    parser.add_argument("--min-digits", type=int)
    parser.add_argument("--max-digits", type=int)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    kwargs = {
        k: v
        for k, v in (("min_digits", args.min_digits), ("max_digits", args.max_digits))
        if v is not None
    }
    records = synthetic_records(
        args.task,
        args.num,
        seed=args.seed,
        split=args.split,
        heldout_fraction=args.heldout_fraction,
        **kwargs,
    )
    write_jsonl(args.out, records)
    print(f"wrote {len(records)} {args.task} {args.split} records to {args.out}")


if __name__ == "__main__":
    main()
