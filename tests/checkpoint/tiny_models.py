"""Tiny random Hugging Face Qwen3 / Qwen3-MoE checkpoints built from configs (no downloads)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

# GQA (4 query heads, 2 KV groups); vocabularies not divisible by TP=2 or the padding multiple.
MOE = dict(
    vocab_size=51,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    max_position_embeddings=128,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
DENSE = dict(
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def build_hf_model(kind: str, out: Path, *, dtype=torch.float32, seed: int = 0, **changes):
    """Save a random tiny model (weights ~N(0, 0.2) so outputs depend on every tensor)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE, **changes}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**{**DENSE, **changes}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(dtype)
    model.save_pretrained(out)
    write_tokenizer(out)
    return model


def write_tokenizer(out: Path) -> None:
    """A small word-level tokenizer saved the HF way (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(out)


def write_inputs(path: Path, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [7, 19, 2, 1, 33, 12, 5, 26]
    seqs = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return seqs


@torch.no_grad()
def transformers_logprobs(hf_dir: Path, sequences: list[list[int]]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for ids in sequences:
        t = torch.tensor([ids])
        logp = torch.log_softmax(model(input_ids=t).logits[0, :-1].float(), dim=-1)
        out.append(logp.gather(-1, t[0, 1:, None])[:, 0].tolist())
    return out
