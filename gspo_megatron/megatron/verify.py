"""Check a conversion by the model's outputs: log-probs of random tokens (a value model's
values) under transformers (HF directory) and under megatron-core (megatron checkpoint) in one
process. `conversion_difference` is the verifier the conversion tools pass to
gspo_megatron.checkpoint.convert.

Both sides hold the same weight values — rounded to the conversion's dtype, then computed in
float32 — so the difference measures the mapping, not the dtype. Needs memory for both full
models; meant for the small and medium models one checks on a workstation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch

from gspo_megatron.spec.model_config import ModelConfig


def random_sequences(vocab_size: int, count: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=gen)


@torch.no_grad()
def transformers_logprobs(
    hf_dir: str | Path, tokens: torch.Tensor, round_to: torch.dtype | None = None
) -> torch.Tensor:
    """[b, s-1] log p(x_t | x_<t) under transformers' AutoModelForCausalLM, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=round_to or torch.float32)
    model = model.float().eval()
    logits = model(input_ids=tokens).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def megatron_outputs(
    megatron_dir: str | Path,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    round_to: torch.dtype | None = None,
    *,
    value_head: bool = False,
    adapters: bool = True,
) -> torch.Tensor:
    """[b, s, ...] float32 outputs (logits, or a value model's values [b, s, 1]) of a
    one-process megatron model loaded from `megatron_dir`, its weights rounded to `round_to`.
    A LoRA checkpoint's model has its adapters, on (the trained policy) or, with
    `adapters=False`, off (the base model)."""
    import torch.distributed as dist

    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.checkpoint.meta import is_checkpoint, read_meta
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.checkpointing import load_model_weights
    from gspo_megatron.megatron.lora import adapters_off
    from gspo_megatron.megatron.model import build_model_chunks
    from gspo_megatron.megatron.weight_loading import load_weights
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.lora import LoRASettings

    saved = read_meta(megatron_dir).get("lora") if is_checkpoint(megatron_dir) else None
    lora = LoRASettings(**saved) if saved else None

    started = not dist.is_initialized()
    if not started and dist.get_world_size() != 1:
        raise RuntimeError("verification builds a one-process model; run it outside torchrun")
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=0)
    try:
        cfg = cfg.replace(params_dtype="float32")
        chunks = build_model_chunks(cfg, layout, use_te=False, value_head=value_head, lora=lora)
        if lora is None:
            load_weights(chunks, cfg, megatron_dir, value_head=value_head)
        else:  # the adapters too (load_weights gives chunks with adapters the base alone)
            load_model_weights(chunks, megatron_dir, cfg)
        model = chunks[0].eval()
        if round_to is not None:
            for p in model.parameters():
                p.copy_(p.to(round_to).float())
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        with contextlib.nullcontext() if adapters else adapters_off(chunks):
            return model(tokens, positions, None).float()
    finally:
        if started:
            parallel.destroy()


def megatron_logprobs(
    megatron_dir: str | Path,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    round_to: torch.dtype | None = None,
    adapters: bool = True,
) -> torch.Tensor:
    """[b, s-1] log-probs under a one-process megatron model loaded from `megatron_dir`."""
    outputs = megatron_outputs(megatron_dir, cfg, tokens, round_to, adapters=adapters)
    logits = outputs[..., : cfg.vocab_size]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def engine_logprobs(
    engine, sequences: Sequence[Sequence[int]], batch_size: int = 64
) -> list[list[float]]:
    """log p(x_t | x_<t), t >= 1, for each sequence under a TrainingEngine's own forward (any
    layout), on every rank: what gspo-logprobs prints and the HF export is checked against.
    Collective."""
    from gspo_megatron.spec.sample import TrainSample

    out: list[list[float]] = [[] for _ in sequences]
    scored = [i for i, s in enumerate(sequences) if len(s) >= 2]  # one token: nothing to score
    dp = engine.layout.dp
    for start in range(0, len(scored), batch_size):
        batch = scored[start : start + batch_size]
        # every data-parallel rank needs at least one sequence: pad with copies, drop after
        padded = batch + [batch[0]] * max(0, dp - len(batch))
        samples = [
            TrainSample(prompt_ids=list(sequences[i][:1]), response_ids=list(sequences[i][1:]))
            for i in padded
        ]
        result = engine.forward(samples)
        for i, lp in zip(batch, result.logprobs, strict=False):
            out[i] = [float(x) for x in lp]
    return out


@torch.no_grad()
def transformers_values(
    hf_dir: str | Path, tokens: torch.Tensor, round_to: torch.dtype | None = None
) -> torch.Tensor:
    """[b, s] a value model's values at every position under transformers'
    AutoModelForSequenceClassification (its head applied to every hidden state), float32."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=round_to)
    model = model.float().eval()
    hidden = model.model(input_ids=tokens).last_hidden_state
    return model.score(hidden)[..., 0].float()


def conversion_difference(
    hf_dir: Path,
    megatron_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype | None,
    value_head: bool,
    adapters: bool = True,
    *,
    count: int = 2,
    length: int = 32,
    seed: int = 0,
) -> tuple[str, float]:
    """The conversion tools' verifier (checkpoint.convert.Verifier): ("value" or "log-prob",
    the max |difference|) of a value model's values at every position, or a policy's
    log-probs, on random token sequences, between transformers and a one-process megatron
    model; both in float32 with the weights rounded to `dtype`; a LoRA checkpoint with its
    adapters on (a merged export) or off (its base)."""
    tokens = random_sequences(cfg.vocab_size, count, min(length, cfg.max_position_embeddings), seed)
    if value_head:
        hf = transformers_values(hf_dir, tokens, dtype)
        mc = megatron_outputs(megatron_dir, cfg, tokens, dtype, value_head=True)[..., 0]
        return "value", float((hf - mc).abs().max())
    hf = transformers_logprobs(hf_dir, tokens, dtype)
    mc = megatron_logprobs(megatron_dir, cfg, tokens, dtype, adapters)
    return "log-prob", float((hf - mc).abs().max())
