"""Value / reward models on megatron (run alone, or under torchrun): one launch, many checks.

For each `kind:source@layout` in --runs (kind: dense | moe; source: hf | mc, the HF
`*ForSequenceClassification` directory or its megatron conversion), the worker loads a
`RewardModel` on that layout, scores the test sequences and compares them with transformers'
scores (computed by the test beforehand), and checks that every rank got the same list; then
tears megatron's parallel state down and goes on with the next run in the same processes.
`--save-after RUN --save-dir DIR` saves that run's engine with megatron's own checkpointing.

With --single (one process) it first checks what needs megatron but no second rank: the
conversion's --verify of a value model, a critic initialised from a policy (HF and megatron,
head="init"), and the refusals.

Prints one JSON line per check on rank 0: {"check", "value", "tol", "ok"} or
{"check", "error"} (an expected refusal's message).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from layout_text import parse_layout

from gspo_megatron.checkpoint.convert import convert_megatron_to_hf
from gspo_megatron.checkpoint.hf_io import HFCheckpoint
from gspo_megatron.checkpoint.reading import read_model_config
from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.model import build_model_chunks
from gspo_megatron.megatron.reward_model import RewardModel
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.megatron.verify import conversion_difference
from gspo_megatron.megatron.weight_loading import load_weights
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.training import EngineSettings

TOL = 1e-4
SETTINGS = EngineSettings(max_sequence_length=64, max_tokens_per_microbatch=96)


def emit(check: str, value=None, tol=None, error: str | None = None) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    if error is not None:
        print(json.dumps({"check": check, "error": error}), flush=True)
        return
    ok = tol is None or value <= tol
    print(json.dumps({"check": check, "value": value, "tol": tol, "ok": ok}), flush=True)


def max_diff(got: list[float], expected: list[float]) -> float:
    return float((torch.tensor(got, dtype=torch.float64) - torch.tensor(expected)).abs().max())


def refusal(check: str, fn) -> None:
    try:
        fn()
    except (ValueError, RuntimeError) as err:  # ConversionError is a ValueError
        emit(check, error=f"{type(err).__name__}: {err}")
    else:
        emit(check, error="no error raised")


def run(spec: str, models: dict, data: dict, world: int, save_dir: str | None) -> None:
    """`kind:source@layout`: load, score, compare with transformers and across ranks."""
    kind_source, _, layout_text = spec.partition("@")
    kind, source = kind_source.split(":")
    layout = parse_layout(layout_text, world)
    parallel.initialize(layout, seed=0)
    rm = RewardModel.load(models[f"{source}_{kind}_vm"], layout, SETTINGS)
    scores = rm.score(data["prompts"], data["responses"])
    emit(f"{spec}", max_diff(scores, data[f"expected_{kind}"]), TOL)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, scores)
    emit(f"{spec}_same_on_every_rank", max(max_diff(g, scores) for g in gathered), 0.0)
    if save_dir is not None:
        checkpointing.save_engine(rm.engine, save_dir, with_optimizer=False)
    rm.close()
    parallel.destroy_model_parallel()


def single_process_checks(models: dict, data: dict) -> None:
    # The converter's --verify of a value model (transformers vs megatron values, every
    # position), before any process group exists, as the conversion tools run it.
    with tempfile.TemporaryDirectory() as tmp:
        report = convert_megatron_to_hf(
            models["mc_moe_vm"], Path(tmp) / "hf", verify=conversion_difference
        )
    emit("convert_verify_values", report.verify_max_abs_diff, TOL)
    emit("convert_verify_says_value", float(report.verified != "value"), 0.0)

    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=0)
    cfg = read_model_config(models["hf_moe_vm"])
    score_weight = HFCheckpoint(models["hf_moe_vm"]).read("score.weight")
    # A critic initialised from the policy (head="init"): the policy's transformer (shared
    # with hf_moe_vm by construction), lm_head ignored, head zero. With hf_moe_vm's head put
    # in, it scores like hf_moe_vm, so every transformer weight was loaded.
    for source in ("hf", "mc"):
        engine = TrainingEngine(cfg, layout, SETTINGS, trainable=False, value_head=True)
        chunk = engine.unwrapped_chunks[0]
        with torch.no_grad():
            for p in chunk.parameters():
                p.fill_(1.0)
            chunk.output_layer.weight.zero_()
        policy = models[f"{source}_moe_policy"]
        load_weights(engine.unwrapped_chunks, cfg, policy, value_head=True, head="init")
        head = float(chunk.output_layer.weight.abs().max())
        emit(f"init_from_{source}_policy_head_stays_zero", head, 0.0)
        with torch.no_grad():
            chunk.output_layer.weight.copy_(score_weight)
        scores = RewardModel(engine).score(data["prompts"], data["responses"])
        emit(f"init_from_{source}_policy_body", max_diff(scores, data["expected_moe"]), TOL)
        engine.close()

    # Refusals: one line each, naming the file and the tensor.
    for source in ("hf", "mc"):
        policy = models[f"{source}_moe_policy"]
        refusal(
            f"refuse_{source}_policy_as_reward_model",
            lambda policy=policy: RewardModel.load(policy, layout, SETTINGS),
        )
    rm = RewardModel.load(models["hf_dense_vm"], layout, SETTINGS)
    dense_cfg = rm.engine.model_config
    policy_chunks = build_model_chunks(dense_cfg, layout, use_te=False)
    for source in ("hf", "mc"):
        refusal(
            f"refuse_{source}_value_model_as_policy",
            lambda source=source: load_weights(
                policy_chunks, dense_cfg, models[f"{source}_dense_vm"]
            ),
        )
    refusal(
        "refuse_init_for_policy",
        lambda: load_weights(policy_chunks, dense_cfg, models["mc_dense_vm"], head="init"),
    )
    refusal(
        "refuse_chunks_without_value_head",
        lambda: load_weights(policy_chunks, dense_cfg, models["mc_dense_vm"], value_head=True),
    )
    refusal("refuse_empty_response", lambda: rm.score([[1, 2]], [[]]))
    limit = rm.max_sequence_length
    refusal("refuse_too_long", lambda: rm.score([[1] * limit], [[2]]))
    # the longest sequence that fits is scored
    emit("longest_scores", float(len(rm.score([[1] * (limit - 1)], [[2]])) != 1), 0.0)
    emit("empty_batch", float(rm.score([], []) != []), 0.0)
    rm.close()
    parallel.destroy_model_parallel()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True, help="JSON dict of model paths")
    parser.add_argument("--data", required=True, help="JSON file: prompts, responses, expected")
    parser.add_argument("--runs", default="", help="';'-separated kind:source@layout")
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--save-after", default=None)
    parser.add_argument("--save-dir", default=None)
    args = parser.parse_args()
    models = json.loads(args.models)
    data = json.loads(Path(args.data).read_text())
    world = parallel.world_size_from_env()
    if args.single:
        single_process_checks(models, data)
    for spec in filter(None, args.runs.split(";")):
        run(spec, models, data, world, args.save_dir if spec == args.save_after else None)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
