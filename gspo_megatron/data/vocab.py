"""Tokenizer / model vocabulary checks: a token id the model has no embedding row for is an
index error deep inside the embedding (or, on GPU, a device-side assert); catch it up front."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from gspo_megatron.data.dataset import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class VocabMismatchError(ValueError):
    """Token ids that the model's embedding cannot hold."""


def check_vocab(tokenizer: PreTrainedTokenizerBase, model_vocab_size: int) -> None:
    """Every id the tokenizer can produce (incl. added/special tokens) must be < model_vocab_size.

    The model's vocabulary may be larger (padded for TP divisibility); never smaller.
    """
    ids = list(tokenizer.get_vocab().values())
    largest = max(ids) if ids else -1
    if largest >= model_vocab_size:
        raise VocabMismatchError(
            f"the tokenizer ({len(tokenizer)} tokens, largest id {largest}) does not fit the "
            f"model's vocabulary of {model_vocab_size}: set the model's vocab_size to at least "
            f"{largest + 1} (padded as the layout needs), or use the tokenizer the model was "
            "trained with"
        )


def check_prompt_ids(prompts: Iterable[Prompt], model_vocab_size: int) -> None:
    """Every prompt token id must be in [0, model_vocab_size)."""
    for p in prompts:
        bad = [t for t in p.prompt_ids if not 0 <= t < model_vocab_size]
        if bad:
            raise VocabMismatchError(
                f"prompt {p.index} has token id {bad[0]} outside the model's vocabulary "
                f"[0, {model_vocab_size}): the data was tokenized with a different tokenizer "
                "than the model's; re-tokenize it or fix model.vocab_size"
            )
