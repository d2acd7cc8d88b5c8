"""Run under torchrun: the engine on one parallel layout, compared with a one-process reference.

`--make-reference DIR` (one process, one padded micro-batch) writes the reference: initial weights
(with optimizer state), per-token log-probs, and for each loss the loss value and the weights
after one SGD step. Any other layout then loads the same initial weights, cuts the same batch into
several micro-batches, padded and then packed (THD), and checks log-probs, loss and updated
weights of both against the reference, and packed against padded on this layout. With SGD (lr 1,
no clipping, no momentum, hence no optimizer state) the weight update *is* the gradient, so a
normalisation error shows up directly (Adam's first step would hide a scale error).

`--lora-rank R`: the same with LoRA adapters of rank R on every target (megatron/lora.py): the
reference's adapters start with a nonzero B (so that A trains too), saved and loaded through the
checkpoint like the weights; each layout also checks that its base model (adapters off) gives the
reference's base log-probs, that B = 0 gives exactly the base model's log-probs, and that
megatron's gradient buffers and optimizer hold the adapters and nothing else.

Prints one JSON line per check on rank 0: {"layout", "check", "value", "tol", "ok"}; checks
are named `padded/...`, `packed/...` and `packed_vs_padded/...`. Several `--layout`s run one
after another in the same processes (process start-up is most of a small layout's time).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from layout_text import parse_layout

from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.lora import adapted_layers, adapters_off
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import load_preset
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

LOSSES = {
    # Wide enough clip ranges that some sequences/tokens are clipped and some are not; an entropy
    # bonus on a sequence-level and a token-level loss (its gradient crosses the vocabulary split).
    "gspo": LossSettings("gspo", {"clip_low": 0.03, "clip_high": 0.03}, entropy_coef=0.02),
    "grpo": LossSettings("grpo", {"clip_low": 0.1, "clip_high": 0.1}),
    "gspo_token": LossSettings("gspo_token", {"clip_low": 0.03, "clip_high": 0.03}),
    "dapo": LossSettings("dapo", entropy_coef=0.05),
}
VOCAB = 48


def model_config(num_layers: int):
    # The aux loss is defined per micro-batch, so it is not invariant to the micro-batch split;
    # it is switched off here and tested on its own.
    return load_preset("tiny_moe", num_hidden_layers=num_layers)


def make_samples(seed: int = 7, count: int = 8) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        response = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 13))]
        samples.append(TrainSample(prompt, response, advantage=rng.gauss(0.0, 1.0)))
    return samples


def build_engine(
    layout: ParallelLayout,
    num_layers: int,
    microbatch_tokens: int,
    packed: bool = False,
    lora: LoRASettings | None = None,
) -> TrainingEngine:
    return TrainingEngine(
        model_config(num_layers),
        layout,
        EngineSettings(
            max_sequence_length=64,
            max_tokens_per_microbatch=microbatch_tokens,
            pack_sequences=packed,
        ),
        OptimizerSettings(
            name="sgd", lr=1.0, clip_grad=0.0, weight_decay=0.0, distributed_optimizer=False
        ),
        lora=lora,
        lora_seed=5,
    )


def with_old_logprobs(samples, logprobs, seed: int = 11) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s, lp in zip(samples, logprobs, strict=True):
        noise = 0.1 * torch.randn(len(lp), generator=gen, dtype=torch.float64)
        old = (torch.as_tensor(lp, dtype=torch.float64) + noise).tolist()
        out.append(TrainSample(s.prompt_ids, s.response_ids, s.advantage, old_logprobs=old))
    return out


def make_reference(out: Path, num_layers: int, lora: LoRASettings | None) -> None:
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=1234)
    engine = build_engine(layout, num_layers, microbatch_tokens=10_000, lora=lora)
    samples = make_samples()
    reference = {"loss": {}}
    if lora is not None:
        reference["base_logprobs"] = [torch.as_tensor(x) for x in engine.forward(samples).logprobs]
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, layer in adapted_layers(engine.unwrapped_chunks):
                layer.lora_b.copy_(0.05 * torch.randn(layer.lora_b.shape, generator=gen))
    checkpointing.save_engine(engine, out / "init", with_optimizer=False)
    result = engine.forward(samples, with_entropy=True)
    reference["logprobs"] = [torch.as_tensor(x) for x in result.logprobs]
    train = with_old_logprobs(samples, result.logprobs)
    for name, loss in LOSSES.items():
        checkpointing.load_engine(engine, out / "init", with_optimizer=False)
        metrics = engine.train_step(train, loss)
        reference["loss"][name] = metrics["loss"]
        checkpointing.save_engine(engine, out / f"after_{name}", with_optimizer=False)
    torch.save(reference, out / "reference.pt")


def trained_weights(engine: TrainingEngine) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.detach().clone() for k, v in chunk.state_dict().items() if torch.is_tensor(v)}
        for chunk in engine.unwrapped_chunks
    ]


def restore(engine: TrainingEngine, weights: list[dict[str, torch.Tensor]]) -> None:
    """Weights taken by `trained_weights` back into the engine (SGD without momentum keeps no
    optimizer state, so this stands for loading the checkpoint again, in memory)."""
    for chunk, state in zip(engine.unwrapped_chunks, weights, strict=True):
        chunk.load_state_dict(state, strict=False)


def weight_differences(engine, expected, initial) -> torch.Tensor:
    """Largest difference of the engine's weights from `expected`, relative to the weights and to
    the update itself (max over ranks). For the latter, differences within two float32 ulps of
    the weight are storage rounding (a norm weight near 1 resolves updates only to ~1e-7)."""
    worst = torch.zeros(2)
    for chunk, ref_sd, init_sd in zip(engine.unwrapped_chunks, expected, initial, strict=True):
        for key, value in chunk.state_dict().items():
            if not torch.is_tensor(value) or key not in ref_sd or "_extra_state" in key:
                continue
            diff = (value - ref_sd[key]).abs().max()
            scale = ref_sd[key].abs().max().clamp_min(1e-12)
            update = (ref_sd[key] - init_sd[key]).abs().max().clamp_min(1e-12)
            beyond_rounding = (diff - 2 * torch.finfo(torch.float32).eps * scale).clamp_min(0)
            worst = torch.maximum(worst, torch.stack([diff / scale, beyond_rounding / update]))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst


def update_sizes(engine, initial) -> torch.Tensor:
    """Largest change of the adapters' A, B and of any base weight since `initial` (max over
    ranks)."""
    sizes = torch.zeros(3)
    for chunk, init_sd in zip(engine.unwrapped_chunks, initial, strict=True):
        for key, value in chunk.state_dict().items():
            if not torch.is_tensor(value) or "_extra_state" in key:
                continue
            part = {"lora_a": 0, "lora_b": 1}.get(key.rsplit(".", 1)[-1], 2)
            sizes[part] = max(sizes[part], float((value - init_sd[key]).abs().max()))
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    return sizes


def max_abs_diff(first, second) -> float:
    return max(
        float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())
        for a, b in zip(first, second, strict=True)
    )


def route_mismatch_fraction(first, second) -> float:
    """Share of (token, layer) entries whose expert sets differ."""
    differ = total = 0
    for a, b in zip(first, second, strict=True):
        a = torch.sort(torch.as_tensor(a), dim=-1).values
        b = torch.sort(torch.as_tensor(b), dim=-1).values
        differ += int((a != b).any(dim=-1).sum())
        total += a.shape[0] * a.shape[1]
    return differ / total


def check_routing_replay(engine, initial, samples, results: list) -> None:
    """Routes recorded in a padded forward stand for a rollout engine's (R3: per sequence, in
    sequence order). In each mode, the routes recorded (R2) must equal them, and replaying them
    must make every router's own choice equal the replayed experts at every token (a route laid
    out at the wrong token would differ) and leave the log-probs unchanged."""
    restore(engine, initial)
    engine.settings.pack_sequences = False
    given = engine.forward(samples, record_routes=True).routes
    with_routes = [replace(s, routed_experts=r) for s, r in zip(samples, given, strict=True)]
    for mode in ("padded", "packed"):
        engine.settings.pack_sequences = mode == "packed"
        recorded = engine.forward(samples, record_routes=True)
        results.append(
            (f"{mode}/recorded_routes_mismatch", route_mismatch_fraction(recorded.routes, given), 0)
        )
        engine.routes.step_metrics()  # counts of earlier forwards
        replayed = engine.forward(with_routes, replay_routes=True)
        change = engine.routes.step_metrics().get("moe/route_change_fraction", -1.0)
        results.append((f"{mode}/replayed_routes_differ_from_router_choice", change, 0))
        lp_err = max_abs_diff(replayed.logprobs, recorded.logprobs)
        results.append((f"{mode}/replayed_logprobs_max_abs_diff", lp_err, 1e-6))


def check_adapters(engine, initial, samples, reference, results: list) -> None:
    """LoRA on this layout: the base model (adapters off) gives the reference's base
    log-probs; B = 0 gives exactly the base model's log-probs; megatron's gradient buffers and
    optimizer hold the adapters' parameters and nothing else."""
    chunks = engine.unwrapped_chunks
    restore(engine, initial)
    with adapters_off(chunks):
        base = engine.forward(samples).logprobs
    lp_err = max_abs_diff(base, reference["base_logprobs"])
    results.append(("lora/base_logprobs_max_abs_diff", lp_err, 1e-5))
    with torch.no_grad():
        for _, layer in adapted_layers(chunks):
            layer.lora_b.zero_()
    fresh = engine.forward(samples).logprobs
    results.append(("lora/fresh_adapter_vs_base_max_abs_diff", max_abs_diff(fresh, base), 0.0))
    restore(engine, initial)
    adapters = {id(p) for _, layer in adapted_layers(chunks) for p in (layer.lora_a, layer.lora_b)}
    optimized = [p for group in engine.optimizer.param_groups for p in group["params"]]
    buffered = [p for m in engine.model for b in m.buffers + m.expert_parallel_buffers
                for p in b.params]  # fmt: skip
    for what, params in (("optimizer", optimized), ("grad_buffers", buffered)):
        outside = sum(id(p) not in adapters for p in params)
        missing = len(adapters - {id(p) for p in params})
        results.append((f"lora/{what}_params_not_adapters", float(outside), 0))
        results.append((f"lora/{what}_adapters_missing", float(missing), 0))
    trainable = sum(p.requires_grad for c in chunks for p in c.parameters())
    results.append(("lora/trainable_params_beyond_adapters", float(trainable - len(adapters)), 0))


def check_layout(
    ref_dir: Path,
    layout: ParallelLayout,
    num_layers: int,
    tokens: int,
    losses: list[str],
    lora: LoRASettings | None = None,
) -> list[tuple[str, float, float | None]]:
    """(check, value, tolerance or None) of every check (rank 0's are reported)."""
    parallel.initialize(layout, seed=1234)
    engine = build_engine(layout, num_layers, microbatch_tokens=tokens, lora=lora)
    reference = torch.load(ref_dir / "reference.pt", weights_only=False)
    checkpointing.load_engine(engine, ref_dir / "init", with_optimizer=False)
    initial = trained_weights(engine)
    samples = make_samples()
    train = with_old_logprobs(samples, [x.numpy() for x in reference["logprobs"]])
    results = []
    if lora is not None:
        check_adapters(engine, initial, samples, reference, results)
    outcome: dict[str, dict] = {}
    expected: dict[str, list] = {}  # the reference's weights after each loss's step
    for mode in ("padded", "packed"):
        engine.settings.pack_sequences = mode == "packed"
        restore(engine, initial)
        logprobs = engine.forward(samples, with_entropy=True).logprobs
        lp_err = max_abs_diff(logprobs, reference["logprobs"])
        results.append((f"{mode}/logprobs_max_abs_diff", lp_err, 1e-5))
        outcome[mode] = {"logprobs": logprobs}
        for name in losses:
            restore(engine, initial)
            metrics = engine.train_step(train, LOSSES[name])
            ref_loss = reference["loss"][name]
            results.append((f"{mode}/{name}_loss_abs_diff", abs(metrics["loss"] - ref_loss), 1e-6))
            if name not in expected:
                expected[name] = checkpointing.load_reference_weights(
                    engine.unwrapped_chunks, ref_dir / f"after_{name}"
                )
            worst = weight_differences(engine, expected[name], initial)
            if lora is not None:
                moved = update_sizes(engine, initial)
                for part, size in zip(("lora_a", "lora_b", "base"), moved.tolist(), strict=True):
                    tol = 0.0 if part == "base" else None  # the base is frozen: exactly
                    results.append((f"{mode}/{name}_{part}_max_update", size, tol))
            results.append((f"{mode}/{name}_params_rel_diff", float(worst[0]), 1e-5))
            results.append((f"{mode}/{name}_update_rel_diff", float(worst[1]), 1e-5))
            count = torch.tensor([metrics["num_microbatches"]])
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            results.append((f"{mode}/{name}_min_microbatches_per_rank", float(count), None))
            results.append((f"{mode}/{name}_padding_fraction", metrics["padding_fraction"], None))
            outcome[mode][name] = (metrics["loss"], trained_weights(engine))
    check_routing_replay(engine, initial, samples, results)
    padded, packed = outcome["padded"], outcome["packed"]
    lp_err = max_abs_diff(packed["logprobs"], padded["logprobs"])
    results.append(("packed_vs_padded/logprobs_max_abs_diff", lp_err, 1e-6))
    for name in losses:
        loss_diff = abs(packed[name][0] - padded[name][0])
        results.append((f"packed_vs_padded/{name}_loss_abs_diff", loss_diff, 1e-6))
        restore(engine, packed[name][1])
        worst = weight_differences(engine, padded[name][1], initial)
        results.append((f"packed_vs_padded/{name}_params_rel_diff", float(worst[0]), 1e-6))
        results.append((f"packed_vs_padded/{name}_update_rel_diff", float(worst[1]), 1e-5))
    engine.close()
    parallel.destroy_model_parallel()
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--make-reference", type=Path)
    parser.add_argument("--ref-dir", type=Path)
    parser.add_argument(
        "--layout", action="append", help="e.g. tp=2,sp=1,pp=2,vpp=2,cp=2,ep=2,etp=1 (repeatable)"
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--microbatch-tokens", type=int, default=48)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--lora-rank", type=int, help="LoRA adapters of this rank")
    args = parser.parse_args()
    lora = LoRASettings(rank=args.lora_rank, alpha=8.0) if args.lora_rank else None
    if args.make_reference:
        make_reference(args.make_reference, args.num_layers, lora)
        return 0
    for text in args.layout or [""]:
        layout = parse_layout(text, parallel.world_size_from_env())
        results = check_layout(
            args.ref_dir,
            layout,
            args.num_layers,
            args.microbatch_tokens,
            args.losses.split(","),
            lora,
        )
        if dist.get_rank() == 0:
            for check, value, tol in results:
                passed = tol is None or value <= tol
                line = {"layout": text, "check": check, "value": value, "tol": tol, "ok": passed}
                print(json.dumps(line), flush=True)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
