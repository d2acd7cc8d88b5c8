"""A trained LoRA checkpoint and the trainer's log-probs of a probe batch, for the export tests
(tests/checkpoint/test_lora_export.py). One process:

    python tests/checkpoint/lora_export_worker.py --hf-dir M [--hf-dir M2] --out O

For each HF model M: a TrainingEngine with LoRA (rank 4, alpha 8, every target, the output layer
and the final norm trained whole) starts from M's weights, takes three Adam steps (B moves away
from zero, the saved modules away from M's), and is saved to O/<M's name>/ckpt; its log-probs of
`verify.random_sequences` go to O/<M's name>/logprobs.pt. Prints one JSON line per model:
{"model", "lora_b_max", "saved_moved"}.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from engine_steps import gspo_steps

from gspo_megatron.checkpoint.hf_io import read_hf_config
from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.lora import adapted_layers
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.megatron.verify import engine_logprobs, random_sequences
from gspo_megatron.megatron.weight_loading import load_weights
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

LORA = LoRASettings(rank=4, alpha=8.0, modules_to_save=["output_layer", "final_norm"])
ADAM = OptimizerSettings(
    name="adam", lr=2e-2, clip_grad=0.0, weight_decay=0.0, distributed_optimizer=False
)
PROBE = dict(count=3, length=24, seed=11)  # what test_lora_export.py compares


def samples(vocab: int, seed: int = 3, count: int = 8) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 8))]
        response = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        out.append(TrainSample(prompt, response, advantage=rng.gauss(0.0, 1.0)))
    return out


def trained_checkpoint(hf_dir: Path, out: Path) -> dict:
    cfg = read_hf_config(hf_dir)[0]
    engine = TrainingEngine(
        cfg, ParallelLayout(world_size=1), EngineSettings(max_sequence_length=64), ADAM,
        lora=LORA, lora_seed=3,
    )  # fmt: skip
    load_weights(engine.unwrapped_chunks, cfg, hf_dir)
    engine.optimizer.reload_model_params()
    head = engine.unwrapped_chunks[0].output_layer.weight.detach().clone()
    batch = samples(cfg.vocab_size)
    gspo_steps(engine, batch, 3)
    out.mkdir(parents=True)
    checkpointing.save_engine(engine, out / "ckpt")
    tokens = random_sequences(cfg.vocab_size, **PROBE)
    logprobs = engine_logprobs(engine, tokens.tolist())
    torch.save({"tokens": tokens, "logprobs": torch.tensor(logprobs)}, out / "logprobs.pt")
    b_max = max(
        float(layer.lora_b.detach().abs().max()) for _, layer in adapted_layers(engine.model)
    )
    moved = float((engine.unwrapped_chunks[0].output_layer.weight - head).abs().max())
    return {"model": hf_dir.name, "lora_b_max": b_max, "saved_moved": moved}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    parallel.initialize(ParallelLayout(world_size=1), seed=3)
    for hf_dir in args.hf_dir:
        print(json.dumps(trained_checkpoint(hf_dir, args.out / hf_dir.name)), flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
