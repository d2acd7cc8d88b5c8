"""A LoRA policy's weight sync on a layout (under torchrun): what `LoRAWeightSource` gathers
equals the policy's own forward, through independent readers.

    python -m torch.distributed.run --nproc-per-node=2 tests/rollout/lora_sync_worker.py tp=2

- merged (rollout.sglang.lora_sync=merged): transformers' Qwen3MoeForCausalLM loading the merged
  weights gives the engine's log-probs with its adapters;
- adapters: PEFT (`peft.PeftModel`) loading the base weights and the PEFT-named adapters gives
  the same log-probs (attention targets: transformers' fused experts have no per-expert linear
  modules for PEFT to wrap);
- the adapters matter: the base model's log-probs are far from both.

Prints one JSON line per check on rank 0: {"check", "value", "tol", "ok"}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from layout_text import parse_layout  # noqa: E402

from gspo_megatron.checkpoint import lora_export  # noqa: E402
from gspo_megatron.checkpoint.mapping import get_mapping  # noqa: E402
from gspo_megatron.megatron import parallel  # noqa: E402
from gspo_megatron.megatron.lora_sync import LoRAWeightSource  # noqa: E402
from gspo_megatron.megatron.training_engine import TrainingEngine  # noqa: E402
from gspo_megatron.spec.lora import LoRASettings  # noqa: E402
from gspo_megatron.spec.model_config import load_preset  # noqa: E402
from gspo_megatron.spec.sample import TrainSample  # noqa: E402
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings  # noqa: E402

TOL = 1e-5  # float32: merged weights or PEFT's unmerged adapters vs megatron's adapters
BUCKET_BYTES = 20_000


def emit(check: str, value: float, tol: float | None = None, ok: bool | None = None) -> None:
    if dist.get_rank() == 0:
        ok = value <= tol if ok is None else ok
        print(json.dumps({"check": check, "value": value, "tol": tol, "ok": bool(ok)}), flush=True)


def samples(vocab: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for n in (9, 23, 5, 14):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out.append(TrainSample(prompt_ids=ids[:1], response_ids=ids[1:]))
    return out


def hf_logprobs(model, batch) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for sample in batch:
            ids = torch.tensor([sample.prompt_ids + sample.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


def worst(a, b) -> float:
    return max(
        float((torch.as_tensor(x) - torch.as_tensor(y)).abs().max())
        for x, y in zip(a, b, strict=True)
    )


def main() -> int:
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    layout = parse_layout(sys.argv[1], int(os.environ.get("WORLD_SIZE", "1")))
    parallel.initialize(layout, seed=7)
    config = load_preset("tiny_moe")
    lora = LoRASettings(
        rank=4, alpha=8.0, targets=["attention.linear_qkv", "attention.linear_proj"]
    )
    engine = TrainingEngine(
        config, layout, EngineSettings(max_sequence_length=48), OptimizerSettings(lr=0.0),
        lora=lora,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)  # the same on every rank: replicas stay equal
    with torch.no_grad():
        for name, p in engine.unwrapped_chunks[0].named_parameters():
            if name.endswith((".lora_a", ".lora_b")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    batch = samples(config.vocab_size)
    expected = engine.forward(batch).logprobs
    source = LoRAWeightSource.from_engine(engine)
    merged = [pair for bucket in source.buckets(BUCKET_BYTES) for pair in bucket]
    base = [pair for bucket in source.base.buckets(BUCKET_BYTES) for pair in bucket]
    adapters = dict(source.adapter_tensors(BUCKET_BYTES))
    if source.is_sender():
        with tempfile.TemporaryDirectory() as tmp:
            for name, weights in (("merged", merged), ("base", base)):
                out = Path(tmp) / name
                out.mkdir()
                save_file(dict(weights), out / "model.safetensors", metadata={"format": "pt"})
                (out / "config.json").write_text(json.dumps(config.to_hf()))
            peft_dir = Path(tmp) / "adapter"
            peft_dir.mkdir()
            save_file({lora_export.PEFT_PREFIX + n: t for n, t in adapters.items()},
                      peft_dir / "adapter_model.safetensors")  # fmt: skip
            settings = dataclasses.asdict(lora)
            adapted = lora_export.adapted_weight_keys(settings, config.is_moe)
            peft_config = lora_export.adapter_config(
                settings, adapted, get_mapping(config), str(Path(tmp) / "base")
            )
            lora_export.write_adapter_config(peft_dir, peft_config)
            load = dict(dtype=torch.float32)
            merged_lp = hf_logprobs(
                AutoModelForCausalLM.from_pretrained(Path(tmp) / "merged", **load).eval(), batch
            )
            base_model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "base", **load).eval()
            base_lp = hf_logprobs(base_model, batch)
            peft_model = PeftModel.from_pretrained(base_model, peft_dir).eval()
            peft_lp = hf_logprobs(peft_model, batch)
        emit("merged_transformers_vs_engine", worst(merged_lp, expected), TOL)
        emit("peft_adapters_vs_engine", worst(peft_lp, expected), TOL)
        gap = worst(base_lp, expected)
        emit("adapters_change_logprobs", gap, ok=gap > 100 * TOL)
    engine.close()
    parallel.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
