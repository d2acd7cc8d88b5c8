"""Weight export worker (run alone for --make-reference, under torchrun otherwise).

--make-reference DIR (one process): a tiny Qwen3-MoE engine with random weights, saved with
megatron's own dist checkpointing (DIR/init), its HF-named export (DIR/export.pt) and the
engine's per-token log-probs on a few sequences (DIR/logprobs.pt).

--ref-dir DIR --layout tp=2,ep=2: load DIR/init on that layout, export through
MegatronWeightSource with small buckets and check on the sender: the same names in the same
order, bitwise equal tensors, bounded buckets; then load the export into transformers'
Qwen3MoeForCausalLM and compare its log-probs with the reference engine's.

Prints one JSON line per check on rank 0: {"check", "value", "tol", "ok"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from layout_text import parse_layout

from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.megatron.weight_export import MegatronWeightSource
from gspo_megatron.rollout.base import WeightSource
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.model_config import ModelConfig
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

CONFIG = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=51,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=96,
    max_position_embeddings=128,
    rope_theta=10000.0,
    make_vocab_size_divisible_by=16,
)
BUCKET_BYTES = 20_000  # smaller than one layer's experts: many buckets


def emit(check: str, value: float, tol: float | None) -> None:
    if dist.get_rank() == 0:
        ok = tol is None or value <= tol
        print(json.dumps({"check": check, "value": value, "tol": tol, "ok": ok}), flush=True)


def samples() -> list[TrainSample]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for n in (9, 23, 5, 14):
        ids = torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()
        out.append(TrainSample(prompt_ids=ids[:1], response_ids=ids[1:]))
    return out


def build(layout: ParallelLayout) -> TrainingEngine:
    parallel.initialize(layout, seed=7)
    return TrainingEngine(
        CONFIG,
        layout,
        EngineSettings(max_sequence_length=32),
        OptimizerSettings(name="sgd", lr=0.0, clip_grad=0.0, distributed_optimizer=False),
    )


def make_reference(out: Path) -> None:
    engine = build(ParallelLayout(world_size=1))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # larger than megatron's init so every weight moves the outputs
        for p in engine.unwrapped_chunks[0].parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    engine.optimizer.reload_model_params()
    checkpointing.save_engine(engine, out / "init", with_optimizer=False)
    source = MegatronWeightSource(engine.unwrapped_chunks, CONFIG)
    exported = [pair for bucket in source.buckets(BUCKET_BYTES) for pair in bucket]
    torch.save(exported, out / "export.pt")
    torch.save(
        [torch.as_tensor(x) for x in engine.forward(samples()).logprobs], out / "logprobs.pt"
    )


def check_layout(ref: Path, layout: ParallelLayout, hf_out: Path) -> None:
    engine = build(layout)
    checkpointing.load_engine(engine, ref / "init", with_optimizer=False, restore_rng=False)
    source = MegatronWeightSource(engine.unwrapped_chunks, CONFIG)
    assert isinstance(source, WeightSource)
    got, oversized, count, empty_elsewhere = [], 0, 0, True
    for bucket in source.buckets(BUCKET_BYTES):
        count += 1
        if source.is_sender():
            got += bucket
            # a bucket stays within the limit unless it is one tensor larger than the limit
            oversized += sum(t.nbytes for _, t in bucket) > BUCKET_BYTES and len(bucket) > 1
        else:
            empty_elsewhere &= bucket == []
    flag = torch.tensor([0.0 if empty_elsewhere else 1.0])
    dist.all_reduce(flag)
    emit("non_senders_hold_nothing", float(flag), 0.0)
    if not source.is_sender():
        return
    reference = torch.load(ref / "export.pt", weights_only=False)
    emit("same_names_same_order", float([n for n, _ in got] != [n for n, _ in reference]), 0.0)
    mismatched = sum(
        1
        for (_, a), (_, b) in zip(got, reference, strict=True)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)
    )
    emit("tensors_bitwise_equal_to_single_process", float(mismatched), 0.0)
    emit("oversized_buckets", float(oversized), 0.0)
    emit("several_buckets", float(count < 5), 0.0)
    emit(
        "per_expert_names",
        float("model.layers.1.mlp.experts.3.up_proj.weight" not in dict(got)),
        0.0,
    )

    # transformers loads the export; its log-probs equal the megatron engine's
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf_out.mkdir(parents=True, exist_ok=True)
    save_file(dict(got), hf_out / "model.safetensors", metadata={"format": "pt"})
    (hf_out / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    model = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
    emit(
        "transformers_class_is_qwen3_moe", float(type(model).__name__ != "Qwen3MoeForCausalLM"), 0.0
    )
    expected = torch.load(ref / "logprobs.pt", weights_only=False)
    worst = 0.0
    with torch.no_grad():
        for sample, ref_lp in zip(samples(), expected, strict=True):
            ids = torch.tensor([sample.prompt_ids + sample.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
            worst = max(worst, float((lp - ref_lp).abs().max()))
    emit("transformers_logprobs_vs_megatron", worst, 1e-5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--make-reference", type=Path)
    parser.add_argument("--ref-dir", type=Path)
    parser.add_argument("--layout", default="tp=2,ep=2")
    parser.add_argument("--hf-out", type=Path)
    args = parser.parse_args()
    if args.make_reference:
        make_reference(args.make_reference)
    else:
        layout = parse_layout(args.layout, parallel.world_size_from_env())
        check_layout(args.ref_dir, layout, args.hf_out)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
