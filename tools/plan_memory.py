"""Per-GPU memory plan of a training run, from the same Hydra overrides as gspo-train.

    python tools/plan_memory.py --nodes 2 --gpus-per-node 8 --gpu-memory-gib 79.6 \\
        model=qwen3_30b_a3b parallel.tp=2 parallel.pp=2 parallel.ep=8 \\
        parallel.sequence_parallel=true engine.max_sequence_length=9216 \\
        engine.max_tokens_per_microbatch=18432 engine.recompute_activations=true

Prints, for each pipeline stage (every rank of a stage holds the same), the parameters and the
GiB of weights, gradients, optimizer state, activations without and with recomputation, the
rollout engine's share and the fixed overhead; the peak while training and while generating; the
worst rank and whether it fits. `--assumptions` prints what the activation estimate assumes.
Exit status: 0 fits, 1 does not fit, 2 bad configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo_megatron.config import ConfigError, compose, resolve  # noqa: E402
from gspo_megatron.memory_plan import (  # noqa: E402
    ASSUMPTIONS,
    PlanError,
    active_params,
    model_params,
    plan,
    settings_from_config,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=79.6,
        help="memory of one GPU (H100/H800 80GB: 79.6, H20: 95.0, H200: 139.8, "
        "A100 80GB: 79.2, A100 40GB: 39.4)",
    )
    rc = p.add_mutually_exclusive_group()
    rc.add_argument(
        "--recompute",
        dest="recompute",
        action="store_true",
        default=None,
        help="plan with full activation recomputation (default: the config's "
        "engine.recompute_activations)",
    )
    rc.add_argument("--no-recompute", dest="recompute", action="store_false")
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        help="tokens of the busiest expert rank over the mean (routing imbalance)",
    )
    p.add_argument(
        "--overhead-gib",
        type=float,
        default=3.0,
        help="fixed per-GPU overhead: CUDA context, NCCL, workspaces",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--assumptions", action="store_true", help="print the estimate's assumptions")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for gspo-train")
    args = p.parse_args(argv)
    world = args.nodes * args.gpus_per_node
    try:
        # A plan reads no input file: they need not exist on the machine that plans.
        run_cfg, model, layout = resolve(compose(args.overrides), world, check_inputs=False)
        settings = settings_from_config(
            run_cfg,
            model,
            layout,
            gpu_memory_gib=args.gpu_memory_gib,
            recompute=args.recompute,
            moe_imbalance=args.moe_imbalance,
            overhead_gib=args.overhead_gib,
        )
        memory = plan(model, layout, settings)
    except (ConfigError, PlanError, ValueError) as err:
        print(f"plan_memory: config error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(memory.to_dict(), indent=2))
        return 0 if memory.fits else 1
    name = run_cfg.model.name
    print(
        f"model {name}: {model_params(model) / 1e9:.2f}B parameters "
        f"({active_params(model) / 1e9:.2f}B active per token), {model.params_dtype}"
    )
    print(
        f"layout: {layout.describe()} on {args.nodes} node(s) x {args.gpus_per_node} GPU(s) "
        f"of {args.gpu_memory_gib:.1f} GiB"
    )
    print(
        f"micro-batch: {settings.micro_batch_tokens} tokens, {settings.microbatches} per "
        f"optimizer step and DP rank; rollout share: {settings.rollout.describe()}"
    )
    print(memory.table())
    if not memory.fits:
        print(f"change: {memory.advice()}")
    print("trainer.offload_during_rollout, worst rank while generating:")
    for option in ("none", "optimizer", "all"):
        other = plan(model, layout, dataclasses.replace(settings, offload_during_rollout=option))
        worst = max(other.stages, key=lambda r: r.generation_peak)
        current = "  (this run)" if option == settings.offload_during_rollout else ""
        print(
            f"  {option:<9} frees {worst.offloaded:6.1f} GiB, generation peak "
            f"{worst.generation_peak:6.1f} GiB; colocated SGLang mem_fraction_static <= "
            f"{other.max_server_fraction:.2f}{current}"
        )
    if args.assumptions:
        print(ASSUMPTIONS)
    else:
        print("(estimate; --assumptions lists what it assumes)")
    return 0 if memory.fits else 1


if __name__ == "__main__":
    sys.exit(main())
