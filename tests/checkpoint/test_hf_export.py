"""The Hugging Face export after a checkpoint (trainer.export_hf_every; megatron/hf_export.py),
on EP2, PP2 and TP2×EP2 layouts of the tiny Qwen3-MoE and of a Qwen3-MoE-shaped model with odd
sizes (tests/checkpoint/hf_export_worker.py): verified by the exporter itself (every rank's share
against its live weights, log-probs against transformers' within 1e-5), written by every rank,
bitwise equal to the model the engine was loaded from, every file in the checkpoint's manifest,
nothing temporary left. A tensor corrupted on its way to disk is caught and named alone; a full
disk and a tokenizer that cannot be saved give one line naming the step and the reason and leave
the checkpoint as it was. A LoRA policy (trained two steps: B non-zero, the saved modules
moved) on one process, on TP2+SP, EP2, PP2 and DP2, and (slow) on TP2+SP+PP2+EP2,
TP2+SP+EP2+ETP2 and TP2+SP+CP2: the export is the merged model, verified by the exporter
against the layers' effective weights and the trainer's log-probs with adapters on, bitwise
equal to what the converter writes from the same weights' checkpoint, and changed from the base
wherever an adapter sits (an export that drops the adapters fails every one of these)."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint.tiny_models import build_hf_model
from launch import run_worker

WORKER = Path(__file__).resolve().parent / "hf_export_worker.py"
# Qwen3-MoE-shaped, every size odd or uneven: vocabulary 67 (not a multiple of anything),
# hidden 40, 6 query heads of 12 dims over 2 KV groups (3 per group), 6 experts of 20, top-3.
ODD = dict(
    vocab_size=67, hidden_size=40, num_attention_heads=6, num_key_value_heads=2, head_dim=12,
    num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20, intermediate_size=56,
)  # fmt: skip
EXPORT_CHECKS = [
    "export_verified",
    "logprobs_vs_transformers",
    "no_suspect_tensor",
    "every_rank_wrote_a_share",
    "tensors_bitwise_equal_to_the_source",
    "manifest_lists_every_file",
    "nothing_temporary_left",
    "config_and_tokenizer",
]
LORA_EXPORT_CHECKS = [
    "merged_bitwise_equal_to_the_converted_checkpoint"
    if c == "tensors_bitwise_equal_to_the_source"
    else c
    for c in EXPORT_CHECKS
] + ["adapters_change_the_export"]
CASE_CHECKS = [
    "corrupted_export_fails",
    "corrupted_tensor_named_alone",
    "failed_export_kept_aside",
    "full_disk_one_line",
    "full_disk_leaves_the_checkpoint_as_it_was",
    "unsavable_tokenizer_refused_up_front",
    "unsavable_tokenizer_at_export",
]


@pytest.fixture(scope="module")
def export_models(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("hf_export_models")
    build_hf_model("moe", root / "tiny_moe", seed=1)
    build_hf_model("moe", root / "odd_moe", seed=2, **ODD)
    return [root / "tiny_moe", root / "odd_moe"]


def run(
    models: list[Path], out: Path, nproc: int, layouts: list[str], cases=(), lora=False
) -> dict:
    args = [a for m in models for a in ("--hf-dir", str(m))] + ["--out", str(out)]
    args += [a for x in layouts for a in ("--layout", x)]
    args += [a for c in cases for a in ("--case", c)]
    args += ["--lora"] if lora else []
    lines = run_worker(WORKER, args, nproc=nproc, timeout=1500)
    return {(r["layout"], r["check"]): r for r in lines if "check" in r}


def assert_all(results: dict, expected: list[tuple[str, str]]) -> None:
    assert sorted(results) == sorted(expected), sorted(set(results) ^ set(expected))
    failed = [r for r in results.values() if not r["ok"]]
    assert not failed, failed


def test_export_on_ep2_and_pp2_with_bad_inputs(export_models, tmp_path):
    models = export_models
    layouts = ["ep=2", "pp=2"]
    results = run(models, tmp_path, 2, layouts, cases=["corrupt", "enospc", "tokenizer"])
    expected = [(f"{m.name}:{x}", c) for m in models for x in layouts for c in EXPORT_CHECKS]
    expected += [(f"{models[0].name}:ep=2", c) for c in CASE_CHECKS]
    assert_all(results, expected)


@pytest.mark.slow
def test_export_on_tp2_ep2(export_models, tmp_path):
    models = export_models
    layout = "tp=2,sp=1,ep=2"
    results = run(models, tmp_path, 4, [layout])
    assert_all(results, [(f"{m.name}:{layout}", c) for m in models for c in EXPORT_CHECKS])


def test_lora_export_on_one_process(export_models, tmp_path):
    results = run(export_models, tmp_path, 1, [""], lora=True)
    assert_all(results, [(f"{m.name}:", c) for m in export_models for c in LORA_EXPORT_CHECKS])


def test_lora_export_on_tp2_sp_ep2_pp2_and_dp2(export_models, tmp_path):
    model = export_models[0]
    layouts = ["tp=2,sp=1", "ep=2", "pp=2", ""]  # "": DP2
    results = run([model], tmp_path, 2, layouts, lora=True)
    assert_all(results, [(f"{model.name}:{x}", c) for x in layouts for c in LORA_EXPORT_CHECKS])


@pytest.mark.slow
def test_lora_export_on_four_ranks(export_models, tmp_path):
    model = export_models[0]
    layouts = ["tp=2,sp=1,pp=2,ep=2", "tp=2,sp=1,ep=2,etp=2", "cp=2,tp=2,sp=1"]
    results = run([model], tmp_path, 4, layouts, lora=True)
    assert_all(results, [(f"{model.name}:{x}", c) for x in layouts for c in LORA_EXPORT_CHECKS])
