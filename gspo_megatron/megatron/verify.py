"""Check a conversion by the model's outputs: log-probs of random tokens (a value model's
values) under transformers (HF directory) and under megatron-core (megatron checkpoint) in one
process. `conversion_difference` is the verifier the conversion tools pass to
gspo_megatron.checkpoint.convert.

Both sides hold the same weight values — rounded to the conversion's dtype, then computed in
float32 — so the difference measures the mapping, not the dtype. Needs memory for both full
models; meant for the small and medium models one checks on a workstation.
"""

from __future__ import annotations

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
) -> torch.Tensor:
    """[b, s, ...] float32 outputs (logits, or a value model's values [b, s, 1]) of a
    one-process megatron model loaded from `megatron_dir`, its weights rounded to `round_to`."""
    import torch.distributed as dist

    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.model import build_model_chunks
    from gspo_megatron.megatron.weight_loading import load_weights
    from gspo_megatron.spec.layout import ParallelLayout

    started = not dist.is_initialized()
    if not started and dist.get_world_size() != 1:
        raise RuntimeError("verification builds a one-process model; run it outside torchrun")
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=0)
    try:
        cfg = cfg.replace(params_dtype="float32")
        chunks = build_model_chunks(cfg, layout, use_te=False, value_head=value_head)
        load_weights(chunks, cfg, megatron_dir, value_head=value_head)
        model = chunks[0].eval()
        if round_to is not None:
            for p in model.parameters():
                p.copy_(p.to(round_to).float())
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        return model(tokens, positions, None).float()
    finally:
        if started:
            parallel.destroy()


def megatron_logprobs(
    megatron_dir: str | Path,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    round_to: torch.dtype | None = None,
) -> torch.Tensor:
    """[b, s-1] log-probs under a one-process megatron model loaded from `megatron_dir`."""
    logits = megatron_outputs(megatron_dir, cfg, tokens, round_to)[..., : cfg.vocab_size]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def compare_logprobs(
    hf_dir: str | Path,
    megatron_dir: str | Path,
    cfg: ModelConfig,
    *,
    round_to: torch.dtype | None = None,
    count: int = 2,
    length: int = 32,
    seed: int = 0,
) -> float:
    """max |log-prob difference| between the two sides on random token sequences."""
    tokens = random_sequences(cfg.vocab_size, count, min(length, cfg.max_position_embeddings), seed)
    hf = transformers_logprobs(hf_dir, tokens, round_to)
    mc = megatron_logprobs(megatron_dir, cfg, tokens, round_to)
    return float((hf - mc).abs().max())


@torch.no_grad()
def compare_values(
    hf_dir: str | Path,
    megatron_dir: str | Path,
    cfg: ModelConfig,
    *,
    round_to: torch.dtype | None = None,
    count: int = 2,
    length: int = 32,
    seed: int = 0,
) -> float:
    """max |value difference| of a value model, at every position of random token sequences,
    between transformers' `AutoModelForSequenceClassification` (its head applied to every
    hidden state) and a one-process megatron model; both in float32 with the weights rounded
    to `round_to` (like `compare_logprobs` for policies)."""
    from transformers import AutoModelForSequenceClassification

    tokens = random_sequences(cfg.vocab_size, count, min(length, cfg.max_position_embeddings), seed)
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=round_to)
    model = model.float().eval()
    hidden = model.model(input_ids=tokens).last_hidden_state
    hf = model.score(hidden)[..., 0].float()
    del model
    mc = megatron_outputs(megatron_dir, cfg, tokens, round_to, value_head=True)[..., 0]
    return float((hf - mc).abs().max())


def conversion_difference(
    hf_dir: Path, megatron_dir: Path, cfg: ModelConfig, dtype: torch.dtype, value_head: bool
) -> tuple[str, float]:
    """The conversion tools' verifier (checkpoint.convert.Verifier): a value model's values,
    or a policy's log-probs, compared between the two sides with the weights in `dtype`."""
    if value_head:
        return "value", compare_values(hf_dir, megatron_dir, cfg, round_to=dtype)
    return "log-prob", compare_logprobs(hf_dir, megatron_dir, cfg, round_to=dtype)
