"""Run under torchrun (or alone): score converted checkpoints on several layouts in one launch.

For each layout in --layouts the worker builds the scoring engine (gspo-logprobs' library
path), loads a checkpoint and compares per-token log-probs with transformers' (computed by the
test beforehand), then tears down megatron's parallel state and goes on with the next layout in
the same processes. With --single (one process) it also checks the strict engine loader, the
TE-spec key set and TE's extra objects. With --cli it finally runs gspo-logprobs' main().

Prints one JSON line per check on rank 0: {"check", "value", "tol", "ok"} or {"check", "error"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from layout_text import parse_layout

from gspo_megatron import logprobs_cli
from gspo_megatron.checkpoint.reading import read_model_config
from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.spec.layout import ParallelLayout

TOL = 1e-5


def emit(check: str, value=None, tol=None, error: str | None = None) -> None:
    # RANK, not the process group: logprobs_cli.main destroys the group it made, and two ranks
    # printing at once interleave their lines.
    if os.environ.get("RANK", "0") != "0":
        return
    if error is not None:
        print(json.dumps({"check": check, "error": error, "ok": False}), flush=True)
        return
    ok = tol is None or value <= tol
    print(json.dumps({"check": check, "value": value, "tol": tol, "ok": ok}), flush=True)


def max_diff(got: list[list[float]], expected: list[list[float]]) -> float:
    worst = 0.0
    for a, b in zip(got, expected, strict=True):
        if len(a) != len(b):
            return float("inf")
        if a:
            worst = max(worst, float((torch.tensor(a) - torch.tensor(b)).abs().max()))
    return worst


def teardown_layout() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def score_layout(
    name: str, checkpoint: Path, layout: ParallelLayout, inputs: Path, expected: list
) -> object:
    sequences = logprobs_cli.read_sequences(inputs)
    engine = logprobs_cli.build_scoring_engine(checkpoint, layout, max_sequence_length=64)
    got = logprobs_cli.score(engine, sequences, batch_size=5)
    emit(name, max_diff(got, expected), TOL)
    return engine


def single_process_checks(models: dict, scoring: dict) -> None:
    """World size 1: engine's strict loader, direct HF loading, TE-spec keys and objects."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from te_spec_keys import te_only_extra_state, te_spec_tensor_shapes
    from torch.distributed.checkpoint import FileSystemReader

    from gspo_megatron.megatron.weight_loading import _local_sharded_tensors

    layout = ParallelLayout(world_size=1)
    expected = json.loads(Path(scoring["expected_moe"]).read_text())
    engine = score_layout(
        "moe_logprobs_single", models["mc_moe"], layout, scoring["in_moe"], expected
    )
    # The engine's own strict loader (load_engine, model only) takes the converted checkpoint.
    with torch.no_grad():
        for p in engine.unwrapped_chunks[0].parameters():
            p.zero_()
    checkpointing.load_engine(engine, models["mc_moe"], with_optimizer=False, restore_rng=False)
    got = logprobs_cli.score(engine, logprobs_cli.read_sequences(scoring["in_moe"]))
    emit("moe_logprobs_single_load_engine_strict", max_diff(got, expected), TOL)

    # The trainer's model.init_from entry points.
    from gspo_megatron.megatron.weight_loading import (
        load_engine_hf_weights,
        load_engine_weights,
    )

    for name, load, path in (
        ("init_from_hf_dir", load_engine_hf_weights, models["hf_moe"]),
        ("init_from_megatron_dir", load_engine_weights, models["mc_moe"]),
    ):
        with torch.no_grad():
            for p in engine.unwrapped_chunks[0].parameters():
                p.zero_()
        load(engine, path)
        got = logprobs_cli.score(engine, logprobs_cli.read_sequences(scoring["in_moe"]))
        emit(f"moe_logprobs_single_{name}", max_diff(got, expected), TOL)

    # Key set: checkpoint == local-spec model == TE spec (written down from megatron's source).
    cfg = read_model_config(models["mc_moe"])
    stored = {
        k: tuple(v.size)
        for k, v in FileSystemReader(str(models["mc_moe"]))
        .read_metadata()
        .state_dict_metadata.items()
        if hasattr(v, "size") and v.size is not None
    }
    local = {}
    for sh in _local_sharded_tensors(engine.unwrapped_chunks[0].sharded_state_dict()):
        local[sh.key] = tuple(sh.global_shape)
    te = te_spec_tensor_shapes(cfg)
    emit("keys_checkpoint_eq_local_spec", float(stored != local), 0.0)
    emit("keys_checkpoint_eq_te_spec", float(stored != te), 0.0)
    if stored != te:
        emit("keys_te_diff", error=str(sorted(set(stored.items()) ^ set(te.items()))))

    # TE modules also ask for their norms' `_extra_state`: the model-only loader skips those
    # (and only those) and loads every weight.
    sharded = checkpointing.model_sharded_state_dict(engine.unwrapped_chunks)
    te_objects = te_only_extra_state(cfg)
    for key, shape, offset in te_objects:
        sharded["chunk0"][f"te.{key}.{offset}"] = ShardedObject(
            key, None, shape, offset, replica_id=0
        )
    names = checkpointing.checkpoint_entry_names(models["mc_moe"])
    filtered, skipped = checkpointing.drop_missing_extra_state(sharded, names, models["mc_moe"])
    want = sorted(ShardedObject(k, None, s, o).unique_key for k, s, o in te_objects)
    emit("te_extra_state_skipped_exactly", float(sorted(skipped) != want), 0.0)
    loaded = dist_checkpointing.load({"model": filtered}, str(models["mc_moe"]))["model"]["chunk0"]
    current = engine.unwrapped_chunks[0].state_dict()
    diffs = [
        float((loaded[k] - current[k]).abs().max())
        for k in current
        if not k.endswith("_extra_state") and k in loaded
    ]
    complete = len(diffs) == sum(1 for k in current if not k.endswith("_extra_state"))
    emit("te_style_load_weights_max_diff", max(diffs) if complete else float("inf"), 0.0)
    teardown_layout()

    # Straight from the HF directory (no conversion), and the dense tied model.
    score_layout(
        "moe_logprobs_single_from_hf", models["hf_moe"], layout, scoring["in_moe"], expected
    )
    teardown_layout()
    dense = json.loads(Path(scoring["expected_dense"]).read_text())
    score_layout("dense_logprobs_single", models["mc_dense"], layout, scoring["in_dense"], dense)
    teardown_layout()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True, help="JSON dict of model paths")
    parser.add_argument("--scoring", required=True, help="JSON dict of inputs/expected paths")
    parser.add_argument("--layouts", default="", help="';'-separated, e.g. ep=2;tp=2,sp=1,ep=2")
    parser.add_argument("--dense-layouts", default="")
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--cli", default=None, help="layout for a final gspo-logprobs main()")
    parser.add_argument("--cli-output", default=None)
    parser.add_argument("--save-after", default=None, help="layout after which to save_engine")
    parser.add_argument("--save-dir", default=None)
    args = parser.parse_args()
    models = {k: Path(v) for k, v in json.loads(args.models).items()}
    scoring = {k: Path(v) for k, v in json.loads(args.scoring).items()}
    world = parallel.world_size_from_env()
    try:
        if args.single:
            single_process_checks(models, scoring)
        for kind, layouts in (("moe", args.layouts), ("dense", args.dense_layouts)):
            expected = json.loads(scoring[f"expected_{kind}"].read_text())
            for text in filter(None, layouts.split(";")):
                layout = parse_layout(text, world)
                engine = score_layout(
                    f"{kind}_logprobs_{text}",
                    models[f"mc_{kind}"],
                    layout,
                    scoring[f"in_{kind}"],
                    expected,
                )
                if kind == "moe" and text == args.save_after:
                    # megatron's own save on this layout: TP/EP-split chunks, TP-padded vocab
                    checkpointing.save_engine(engine, args.save_dir, with_optimizer=False)
                teardown_layout()
        if args.cli:
            values = dict(item.split("=") for item in args.cli.split(","))
            argv = [
                "--checkpoint",
                str(models["hf_moe"]),
                "--input",
                str(scoring["in_moe"]),
                "--output",
                args.cli_output,
                "--batch-size",
                "3",
            ]
            for key, value in values.items():
                argv += [f"--{key}", value]
            code = logprobs_cli.main(argv)
            emit("cli_exit_code", float(code), 0.0)
    except Exception:  # noqa: BLE001 - reported to the test, then re-raised
        emit("worker", error=traceback.format_exc())
        raise
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
