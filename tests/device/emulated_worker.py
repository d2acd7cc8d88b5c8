"""Engine, rollout and weight export under the emulated accelerator (see test_emulated.py).

    python tests/device/emulated_worker.py --modes train,forward
    torchrun --nproc-per-node=2 tests/device/emulated_worker.py --layout tp=2,sp=1 --modes train \
        --layout pp=2 --modes train,replay

The emulation is enabled before megatron is imported. Every layout first proves it is active (a
deliberately mixed op raises; the model's parameters are device tensors), then runs its modes;
several layouts run one after another in the same processes. Prints JSON lines on rank 0:
{"layout", "check", "ok", "detail"}. With --record, refused ops do not raise: each rank prints
what it caught as {"layout", "finding", "rank"} lines (a survey of the code paths).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import device_emulation

device_emulation.enable(record="--record" in sys.argv)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from layout_text import parse_layout  # noqa: E402

from gspo_megatron.device import accelerator  # noqa: E402
from gspo_megatron.megatron import parallel  # noqa: E402
from gspo_megatron.megatron.offload import StateOffloader  # noqa: E402
from gspo_megatron.megatron.training_engine import TrainingEngine  # noqa: E402
from gspo_megatron.megatron.weight_export import MegatronWeightSource  # noqa: E402
from gspo_megatron.rollout.base import SamplingParams  # noqa: E402
from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine  # noqa: E402
from gspo_megatron.spec.layout import ParallelLayout  # noqa: E402
from gspo_megatron.spec.loss import LossSettings  # noqa: E402
from gspo_megatron.spec.model_config import load_preset  # noqa: E402
from gspo_megatron.spec.sample import TrainSample  # noqa: E402
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings  # noqa: E402

VOCAB = 48
RESULTS: list[dict] = []
ADAM = OptimizerSettings(name="adam", lr=1e-3, weight_decay=0.01, distributed_optimizer=True)
SGD = OptimizerSettings(
    name="sgd", lr=0.1, clip_grad=1.0, weight_decay=0.01, distributed_optimizer=False
)


def check(name: str, ok: bool, detail: object = None) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), "detail": detail})


def samples(count: int = 6, seed: int = 3) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))]
        response = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        out.append(TrainSample(prompt, response, advantage=rng.gauss(0.0, 1.0)))
    return out


def with_old(batch: list[TrainSample], result, routes=None) -> list[TrainSample]:
    return [
        TrainSample(
            s.prompt_ids,
            s.response_ids,
            s.advantage,
            old_logprobs=[float(x) - 0.01 for x in lp],
            routed_experts=None if routes is None else routes[i],
        )
        for i, (s, lp) in enumerate(zip(batch, result.logprobs, strict=True))
    ]


def build(layout: ParallelLayout, optimizer: OptimizerSettings) -> TrainingEngine:
    # a budget of 48 padded tokens gives every rank several micro-batches
    settings = EngineSettings(max_sequence_length=40, max_tokens_per_microbatch=48)
    return TrainingEngine(load_preset("tiny_moe"), layout, settings, optimizer)


def prove_active(engine: TrainingEngine) -> None:
    """The emulation is on: mixing raises, and the model lives on the emulated device."""
    recorded = len(device_emulation.findings)
    try:
        torch.ones(2, device=accelerator()) + torch.ones(2)
        refused = len(device_emulation.findings) > recorded  # --record: collected, not raised
        del device_emulation.findings[recorded:]
    except device_emulation.DeviceMixError:
        refused = True
    check("mixed_op_refused", refused)
    params = [p for chunk in engine.unwrapped_chunks for p in chunk.parameters()]
    on_device = all(device_emulation.on_device(p) for p in params)
    check("params_on_device", on_device and str(params[0].device) == "cuda:0", len(params))


def mode_train(engine: TrainingEngine, layout: ParallelLayout) -> None:
    batch = samples()
    for name, optimizer in (("adam", ADAM), ("sgd", SGD)):
        if name == "sgd" and layout.world_size > 1:
            continue  # the single process covers megatron's non-distributed optimizer
        eng = engine if name == "adam" else build(layout, optimizer)
        train = with_old(batch, eng.forward(batch))
        metrics = eng.train_step(train, LossSettings("gspo"))
        finite = all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        check(f"train_step_{name}", finite and metrics["skipped"] == 0.0, metrics["loss"])
    check("optimizer_steps", engine.steps_done == 1, engine.steps_done)


def mode_forward(engine: TrainingEngine, layout: ParallelLayout) -> None:
    batch = samples()
    result = engine.forward(batch, with_entropy=True, record_routes=True)
    lengths_ok = all(
        len(lp) == len(s.response_ids) for lp, s in zip(result.logprobs, batch, strict=True)
    )
    check("forward_logprobs", lengths_ok, len(result.logprobs))
    check("forward_entropy", result.entropy is not None and len(result.entropy) == len(batch))
    routes_ok = result.routes is not None and all(
        r.shape[0] == s.length - 1 for r, s in zip(result.routes, batch, strict=True)
    )
    check("forward_routes", routes_ok)


def mode_replay(engine: TrainingEngine, layout: ParallelLayout) -> None:
    batch = samples()
    old = engine.forward(batch, record_routes=True)  # R2: routes of the old-policy forward
    train = with_old(batch, old, old.routes)
    compared = engine.train_step(train, LossSettings("gspo"))
    check("r2_route_change_measured", "moe/route_change_fraction" in compared)
    replayed = engine.train_step(train, LossSettings("gspo"), replay_routes=True)
    check("r2_replay_step", replayed["skipped"] == 0.0, replayed["loss"])
    # R3: the rollout engine's routes replayed in a forward
    again = engine.forward(train, record_routes=True, replay_routes=True)
    same = all(
        bool(
            (
                torch.sort(torch.as_tensor(a), -1).values
                == torch.sort(torch.as_tensor(b), -1).values
            ).all()
        )
        for a, b in zip(old.routes, again.routes, strict=True)
    )
    check("r3_replay_forward", same)


def mode_rollout(engine: TrainingEngine, layout: ParallelLayout) -> None:
    prompts = [[random.Random(p).randrange(VOCAB) for _ in range(2 + p)] for p in range(4)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    backends = ["megatron"] if layout.tp * layout.ep > 1 else ["torch", "megatron"]
    for backend in backends:
        rollout = EmbeddedEngine(engine, backend=backend, record_routes=True, max_batch_tokens=40)
        groups = rollout.generate(prompts, 2, params)
        shapes_ok = all(
            len(s.logprobs) == len(s.response_ids) >= 1
            and s.routed_experts is not None
            and s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1
            for g in groups
            for s in g
        )
        check(f"rollout_{backend}", rollout.decoder.name == backend and shapes_ok)


def mode_export(engine: TrainingEngine, layout: ParallelLayout) -> None:
    source = MegatronWeightSource.from_engine(engine)
    names, on_device = [], True
    for bucket in source.buckets(20_000):
        for name, tensor in bucket:
            names.append(name)
            on_device &= device_emulation.on_device(tensor)
    if source.is_sender():
        check("export_names", "model.layers.1.mlp.experts.3.up_proj.weight" in names, len(names))
        check("export_buckets_on_device", on_device)


def mode_offload(engine: TrainingEngine, layout: ParallelLayout) -> None:
    """After offloading everything no parameter, gradient buffer or optimizer tensor keeps
    device storage, the copies are host tensors, and training goes on after the reload."""
    batch = samples()
    train = with_old(batch, engine.forward(batch))
    engine.train_step(train, LossSettings("gspo"))  # Adam's state exists from the first step
    params = [p for chunk in engine.unwrapped_chunks for p in chunk.parameters()]
    grads = [b.grad_data for m in engine.model for b in (*m.buffers, *m.expert_parallel_buffers)]
    state = [
        v
        for part in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        for s in part.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and device_emulation.on_device(v)
    ]
    offloader = StateOffloader(engine, "all", keep_weights=False)
    moved = offloader.offload()
    left = [t for t in params + grads + state if t.untyped_storage().nbytes() > 0]
    check("offload_leaves_nothing_on_device", not left and bool(state), len(left))
    copies = offloader.host_copies
    check(
        "offload_copies_on_host",
        bool(copies) and not any(device_emulation.on_device(c) for c in copies),
        moved["offload_bytes"],
    )
    offloader.reload()
    back = all(device_emulation.on_device(p) for p in params)
    metrics = engine.train_step(train, LossSettings("gspo"))
    check("offload_reload_then_train", back and metrics["skipped"] == 0.0, metrics["loss"])


MODES = {
    "offload": mode_offload,
    "train": mode_train,
    "forward": mode_forward,
    "replay": mode_replay,
    "rollout": mode_rollout,
    "export": mode_export,
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--modes", action="append", required=True, help="per --layout (repeatable, in order)"
    )
    parser.add_argument("--layout", action="append", help="default: one rank, no parallelism")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    layouts = args.layout or [""]
    if len(layouts) != len(args.modes):
        parser.error("give one --modes per --layout")
    for text, modes in zip(layouts, args.modes, strict=True):
        check_layout(text, modes.split(","), args.record)
    parallel.destroy()
    return 0  # the checks' outcomes are in the lines printed


def check_layout(text: str, modes: list[str], record: bool) -> None:
    """`modes` on one layout (after the proof that the emulation is on); rank 0 prints the
    results, each naming the layout."""
    layout = parse_layout(text, parallel.world_size_from_env())
    parallel.initialize(layout, seed=1234)
    engine = build(layout, ADAM)
    start = len(RESULTS)
    prove_active(engine)
    for mode in modes:
        MODES[mode](engine, layout)
    rank = dist.get_rank()
    if record:
        for finding in device_emulation.findings:
            print(json.dumps({"layout": text, "finding": finding, "rank": rank}), flush=True)
        device_emulation.findings.clear()
    if rank == 0:
        for result in RESULTS[start:]:
            print(json.dumps({"layout": text, **result}), flush=True)
    engine.close()
    parallel.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
