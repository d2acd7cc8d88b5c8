"""Tiny HF models, their megatron conversions, scoring inputs and transformers' log-probs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint.tiny_models import build_hf_model, transformers_logprobs, write_inputs


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """HF dirs (moe: GQA, untied, vocab 51; dense: tied, vocab 61) and their conversions."""
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("ckpt_models")
    paths = {}
    for kind in ("moe", "dense"):
        build_hf_model(kind, root / f"hf_{kind}")
        convert_hf_to_megatron(root / f"hf_{kind}", root / f"mc_{kind}")
        paths[f"hf_{kind}"] = root / f"hf_{kind}"
        paths[f"mc_{kind}"] = root / f"mc_{kind}"
    return paths


@pytest.fixture(scope="session")
def scoring(models, tmp_path_factory) -> dict[str, Path]:
    """Input JSONL per model and transformers' fp32 log-probs for it (expected_<kind>.json)."""
    root = tmp_path_factory.mktemp("ckpt_scoring")
    out = {}
    for kind, vocab in (("moe", 51), ("dense", 61)):
        seqs = write_inputs(root / f"in_{kind}.jsonl", vocab, seed=len(kind))
        expected = transformers_logprobs(models[f"hf_{kind}"], seqs)
        (root / f"expected_{kind}.json").write_text(json.dumps(expected))
        out[f"in_{kind}"] = root / f"in_{kind}.jsonl"
        out[f"expected_{kind}"] = root / f"expected_{kind}.json"
    return out
