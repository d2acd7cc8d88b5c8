"""Count the parameters of megatron's own model, per rank, for the planner test.

For each case (preset, layout, ranks) this process joins a *fake* process group of the layout's
world size as the given rank (torch's test backend: no other process, collectives are no-ops),
initialises megatron's parallel state, builds the policy with gspo_megatron.megatron.model on the
meta device (no memory, no initialisation) and prints one JSON line per rank with the numbers of
dense and expert (`.mlp.experts.`) parameters; a case with "lora_rank" builds the model with
LoRA adapters of that rank on every target and counts them apart (`adapter_dense`,
`adapter_expert`), and the weights they sit on (`adapted_weights`).

    python tests/planner/count_worker.py '[{"preset": "tiny_moe", "world": 1, "ranks": [0],
                                           "layout": {}}]'
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from gspo_megatron.megatron import parallel  # noqa: E402
from gspo_megatron.megatron.lora import adapted_layers  # noqa: E402
from gspo_megatron.megatron.model import build_model_chunks, transformer_config  # noqa: E402
from gspo_megatron.spec.layout import ParallelLayout  # noqa: E402
from gspo_megatron.spec.lora import LoRASettings  # noqa: E402
from gspo_megatron.spec.model_config import load_preset  # noqa: E402

warnings.filterwarnings("ignore")


def count(preset: str, layout: ParallelLayout, rank: int, lora_rank: int | None) -> dict:
    model = load_preset(preset)
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        parallel.initialize_model_parallel(layout, create_gloo_process_groups=False)
        config = dataclasses.replace(
            transformer_config(model, layout), perform_initialization=False
        )
        with torch.device("meta"):
            chunks = build_model_chunks(
                model, layout, config=config, use_te=False, lora=LoRASettings(rank=lora_rank)
            )
        named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
        adapters = [(n, p) for n, p in named if n.endswith((".lora_a", ".lora_b"))]
        params = [(n, p) for n, p in named if not n.endswith((".lora_a", ".lora_b"))]
        expert = sum(p.numel() for n, p in params if ".mlp.experts." in n)
        total = sum(p.numel() for _, p in params)
        adapter_expert = sum(p.numel() for n, p in adapters if ".mlp.experts." in n)
        adapted = [layer.weight for _, layer in adapted_layers(chunks)]
        return {
            "adapted_weights": sum(w.numel() for w in adapted),
            "adapter_dense": sum(p.numel() for _, p in adapters) - adapter_expert,
            "adapter_expert": adapter_expert,
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "dense": total - expert,
            "expert": expert,
        }
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main() -> None:
    for case in json.loads(sys.argv[1]):
        layout = ParallelLayout(world_size=case["world"], **case["layout"])
        for rank in case["ranks"]:
            out = count(case["preset"], layout, rank, case.get("lora_rank"))
            print(
                json.dumps(
                    {
                        "preset": case["preset"],
                        "world": case["world"],
                        "layout": case["layout"],
                        "rank": rank,
                        "lora_rank": case.get("lora_rank"),
                        **out,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
