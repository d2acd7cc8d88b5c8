"""A learned reward model: a frozen value-head model that scores whole sequences.

`RewardModel.load(path, layout, settings)` builds a frozen `TrainingEngine(value_head=True,
trainable=False)` on the current parallel layout (megatron's parallel state must be initialised
for it, as for the policy) and loads an HF `*ForSequenceClassification` directory with one label
or a gspo-megatron checkpoint with a value head (docs/CHECKPOINTS.md, "Value and reward
models"). `score(prompts, responses)` gives one float per sequence: the head's output at the
sequence's last token, which is what transformers' sequence classification reads (its last
non-pad token). It is collective: every rank calls it with the same inputs and gets the same
scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from gspo_megatron.checkpoint.reading import check_head, read_model_config
from gspo_megatron.megatron.batch import padded_length
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.megatron.weight_loading import load_weights
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings


class RewardModel:
    """Scores (prompt, response) token sequences with a frozen value-head engine.

    engine: a TrainingEngine built with value_head=True (usually trainable=False).
    placeholder_id: the token appended to every sequence to read the value at its last token
    (any id in the vocabulary; it cannot change the score, see `score`).
    """

    def __init__(self, engine: TrainingEngine, *, placeholder_id: int = 0) -> None:
        if not engine.value_head:
            raise ValueError("a RewardModel needs an engine built with value_head=True")
        if not 0 <= placeholder_id < engine.model_config.vocab_size:
            raise ValueError(
                f"placeholder_id={placeholder_id} is outside the reward model's vocabulary "
                f"[0, {engine.model_config.vocab_size})"
            )
        self.engine = engine
        self.placeholder_id = placeholder_id

    @classmethod
    def load(
        cls,
        path: str | Path,
        layout: ParallelLayout,
        settings: EngineSettings | None = None,
        *,
        params_dtype: str | None = None,
    ) -> RewardModel:
        """A reward model on `layout` (parallel state already initialised) from an HF
        `*ForSequenceClassification` directory (one label) or a megatron checkpoint with a
        value head; a policy checkpoint is refused before the model is built. Collective.

        settings: the engine section to batch with, e.g. the policy's. Scoring appends one
        token, so the engine gets one more position (rounded up to the layout's sequence
        multiple) in max_sequence_length, and max_tokens_per_microbatch at least that: every
        sequence that fits `settings` can be scored.
        params_dtype: float32 | bfloat16 | float16; default: the checkpoint's.
        """
        overrides = {"params_dtype": params_dtype} if params_dtype else {}
        model_config = read_model_config(path, **overrides)
        check_head(path, model_config, value_head=True, head="load")
        settings = settings or EngineSettings()
        longest = padded_length(settings.max_sequence_length + 1, layout.sequence_multiple)
        settings = dataclasses.replace(
            settings,
            max_sequence_length=longest,
            max_tokens_per_microbatch=max(settings.max_tokens_per_microbatch, longest),
        )
        engine = TrainingEngine(model_config, layout, settings, trainable=False, value_head=True)
        load_weights(engine.unwrapped_chunks, model_config, path, value_head=True, head="load")
        return cls(engine)

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt + response this model scores (one position goes to the
        placeholder token)."""
        return self.engine.settings.max_sequence_length - 1

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[float]:
        """The reward of each prompt + response: the head's output at the response's last
        token. Collective: call on every rank with the same inputs; every rank gets the same
        list. Batched through the engine's micro-batching (engine.max_tokens_per_microbatch).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        vocab = self.engine.model_config.vocab_size
        samples = []
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            if not response:
                raise ValueError(
                    f"sequence {i}: empty response (the reward is read at the response's last "
                    "token)"
                )
            ids = [*prompt, *response]
            if len(ids) + 1 > self.engine.settings.max_sequence_length:
                raise ValueError(
                    f"sequence {i}: prompt + response of {len(ids)} tokens plus the placeholder "
                    f"token scoring appends ({len(ids) + 1}) exceed the reward model's "
                    f"engine.max_sequence_length={self.engine.settings.max_sequence_length}"
                )
            if min(ids) < 0 or max(ids) >= vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(
                    f"sequence {i}: token id {bad} is outside the reward model's vocabulary "
                    f"[0, {vocab})"
                )
            # The engine returns, for response token j, the value at the position before it:
            # for this one placeholder token, the value at the sequence's last token. Attention
            # is causal (and MoE routing is per token, with no capacity limit), so the
            # placeholder cannot change any output before it: the value is the one the
            # sequence alone gives at its last token.
            samples.append(TrainSample(prompt_ids=ids, response_ids=[self.placeholder_id]))
        if not samples:
            return []
        # Every data-parallel rank needs a sequence (and the interleaved pipeline schedule
        # pp micro-batches each): fill with copies of the first, dropped afterwards.
        layout = self.engine.layout
        need = layout.dp * (layout.pp if layout.vpp > 1 else 1)
        filled = samples + [samples[0]] * max(0, need - len(samples))
        values = self.engine.forward(filled).values
        return [float(v[0]) for v in values[: len(samples)]]

    def close(self) -> None:
        """Let the engine's model and process-group references be freed."""
        self.engine.close()
