"""The trainer's state with LoRA against full-parameter training, measured side by side on one
process: parameters, trained parameters, Adam's state and DDP's gradient buffers after one
step of tiny_moe (docs/LORA.md, "State measured").

    python benchmarks/bench_lora_state.py [--preset tiny_moe] [--rank 8]
"""

from __future__ import annotations

import argparse

import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from gspo_megatron.megatron import parallel  # noqa: E402
from gspo_megatron.megatron.checkpointing import _sub_optimizers  # noqa: E402
from gspo_megatron.megatron.training_engine import TrainingEngine  # noqa: E402
from gspo_megatron.spec.layout import ParallelLayout  # noqa: E402
from gspo_megatron.spec.lora import LoRASettings  # noqa: E402
from gspo_megatron.spec.loss import LossSettings  # noqa: E402
from gspo_megatron.spec.model_config import load_preset  # noqa: E402
from gspo_megatron.spec.sample import TrainSample  # noqa: E402


def measure(preset: str, lora: LoRASettings | None) -> dict:
    layout = ParallelLayout(world_size=1)
    engine = TrainingEngine(load_preset(preset), layout, lora=lora)
    batch = [TrainSample([1, 2, 3], [4, 5], advantage=1.0, old_logprobs=[-3.0, -3.0])]
    engine.train_step(batch, LossSettings("gspo"))
    params = [p for chunk in engine.unwrapped_chunks for p in chunk.parameters()]
    state = sum(
        t.numel() * t.element_size()
        for sub in _sub_optimizers(engine.optimizer)
        for s in sub.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0  # not Adam's step counter
    )
    grads = sum(
        b.grad_data.numel() * b.grad_data.element_size()
        for m in engine.model
        for b in m.buffers + m.expert_parallel_buffers
    )
    engine.close()
    return {
        "params": sum(p.numel() for p in params),
        "trained": sum(p.numel() for p in params if p.requires_grad),
        "adam_bytes": state,
        "grad_bytes": grads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny_moe")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    parallel.initialize(ParallelLayout(world_size=1), seed=0)
    runs = {
        "full": None,
        f"lora.rank={args.rank}": LoRASettings(rank=args.rank),
        f"lora.rank={args.rank} + output_layer, final_norm": LoRASettings(
            rank=args.rank, modules_to_save=["output_layer", "final_norm"]
        ),
    }
    full = None
    print(f"{'':45} {'params':>9} {'trained':>9} {'adam B':>10} {'grads B':>9} {'adam/full':>9}")
    for name, lora in runs.items():
        m = measure(args.preset, lora)
        full = full or m
        ratio = m["adam_bytes"] / full["adam_bytes"]
        print(
            f"{name:45} {m['params']:>9,} {m['trained']:>9,} {m['adam_bytes']:>10,} "
            f"{m['grad_bytes']:>9,} {ratio:>9.3f}"
        )
    parallel.destroy()


if __name__ == "__main__":
    main()
