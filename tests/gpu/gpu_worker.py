"""The one-GPU suite's checks, in a process of their own (megatron keeps global parallel state).

    python tests/gpu/gpu_worker.py --checks train,generate,export,checkpoint
    CUDA_VISIBLE_DEVICES= python tests/gpu/gpu_worker.py --cpu-reference DIR
    python tests/gpu/gpu_worker.py --checks logprobs --reference DIR

Run by tests/gpu/test_gpu_suite.py (one check per test) and by benchmarks/gpu_check.py (all in
one process). Every check runs the tiny Qwen3-MoE (conf/model/tiny_moe.yaml, vocabulary 100 so
that megatron pads it to 112) in bf16, one process, NCCL at world size 1; --allow-cpu runs the
same code on CPU (gloo), which is how the script itself is checked without a GPU.

Checks (each prints JSON lines {"check", "value", "tol", "ok", "detail"}; a check that raises
prints one failing line with the error and the next check still runs):
- train:      TrainingEngine.train_step (GSPO, Adam on the distributed optimizer): finite loss and
              gradient norm, weights change, and three steps with advantage +1 raise the
              responses' log-probs.
- generate:   EmbeddedEngine.generate with each decoder (auto, megatron): sampled log-probs vs
              TrainingEngine.forward's recompute of the same tokens, routes replayed (R3).
- export:     MegatronWeightSource buckets: on the GPU, bf16, HF names and shapes of the mapping;
              transformers' Qwen3MoeForCausalLM on the exported weights vs the engine.
- checkpoint: save_engine / load_engine after two Adam steps: identical weights, Adam state and
              scheduler; the next step is identical too.
- logprobs:   bf16 log-probs on this device vs fp32 log-probs on CPU of the same weights (a
              checkpoint written by --cpu-reference), CPU routes replayed.

Tolerance for bf16 log-probs (LOGPROB_TOL, LOGPROB_MEAN_TOL; docs/ENGINE.md "GPU" says more).
bf16 keeps 8 significant bits: each rounding moves a value by up to 2^-9 (~2e-3) of itself. A
log-prob z_t - logsumexp(z) inherits that relative error of the logits (std ~1, |z| up to ~4
here: up to ~8e-3 from the last rounding alone) plus that of every earlier layer's outputs. Measured
with `--measure-bf16 40` (CPU bf16 vs CPU fp32, 40 weight draws, 8,684 tokens, fp32 routes
replayed): median 5.2e-3, 99th percentile 2.1e-2, 99.9th 2.8e-2, max 3.7e-2, mean 6.3e-3.
Tolerances: max 0.1 and mean 0.02, about 3x the measured worst and mean, for GPU kernels'
other accumulation orders. Routes are replayed because a bf16 router flips a near-tied expert
choice for ~1% of token-layers (193 of 23,046), which moved single log-probs by up to 0.76 there
(reported, not checked).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.megatron.weight_export import MegatronWeightSource, export_shape
from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import ModelConfig, load_preset
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

VOCAB = 100
MAX_LEN = 64
# Max |Δ log-prob| over all response tokens (nats), and the mean |Δ|, for bf16 vs fp32 and for
# two bf16 computations of the same tokens (decode with a KV cache vs a full forward).
LOGPROB_TOL = 0.1
LOGPROB_MEAN_TOL = 0.02
ADAM = OptimizerSettings(name="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0)


def model_config(dtype: str) -> ModelConfig:
    return load_preset("tiny_moe", vocab_size=VOCAB, params_dtype=dtype)


def build(dtype: str = "bfloat16", optimizer: OptimizerSettings = ADAM) -> TrainingEngine:
    settings = EngineSettings(max_sequence_length=MAX_LEN, max_tokens_per_microbatch=256)
    return TrainingEngine(
        model_config(dtype), ParallelLayout(), settings, optimizer, decay_steps=10
    )


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def randomize(engine: TrainingEngine, seed: int) -> None:
    """Seeded weights with O(1) activations and logits spread over a few nats.

    megatron's init (std 0.02) gives near-uniform log-probs, where precision is not tested:
    linear weights ~ N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2). Drawn
    on CPU in float32 in a fixed order, so every device and dtype gets the same values (rounded
    to its dtype).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(engine.unwrapped_chunks[0].named_parameters()):
            if p.dim() == 1:
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif "embedding" in name:
                values = torch.randn(p.shape, generator=gen)
            else:
                values = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            p.copy_(values)
    engine.optimizer.reload_model_params()  # the fp32 main copies follow


def samples(seed: int, count: int = 8) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        prompt = int(torch.randint(2, 10, (), generator=gen))
        response = int(torch.randint(4, 24, (), generator=gen))
        ids = torch.randint(0, VOCAB, (prompt + response,), generator=gen).tolist()
        adv = float(torch.randn((), generator=gen))
        out.append(TrainSample(ids[:prompt], ids[prompt:], advantage=adv))
    return out


def with_old_logprobs(engine: TrainingEngine, batch: list[TrainSample], advantage=None):
    """The batch with old log-probs = the engine's current ones (ratio 1, GSPO unclipped)."""
    logprobs = engine.forward(batch).logprobs
    return [
        TrainSample(
            s.prompt_ids,
            s.response_ids,
            s.advantage if advantage is None else advantage,
            old_logprobs=[float(x) for x in lp],
        )
        for s, lp in zip(batch, logprobs, strict=True)
    ]


def token_diffs(a: list, b: list) -> torch.Tensor:
    """|a - b| over all tokens of two lists of per-sample log-prob arrays (float64, flat)."""
    pairs = zip(a, b, strict=True)
    return torch.cat([(_f64(x) - _f64(y)).abs().flatten() for x, y in pairs])


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64).cpu()


def diff_stats(a: list, b: list) -> tuple[float, float, int]:
    """(max, mean, count) of token_diffs."""
    d = token_diffs(a, b)
    return float(d.max()), float(d.mean()), d.numel()


def route_flips(a: list, b: list) -> int:
    """Token-layers whose top-k experts differ between two lists of [tokens, layers, k] routes."""
    return sum(int((_f64(x) != _f64(y)).any(-1).sum()) for x, y in zip(a, b, strict=True))


class Report:
    def __init__(self) -> None:
        self.ok = True

    def emit(self, check: str, value: float, tol: float | None = None, *, ok=None, detail=""):
        """ok defaults to value <= tol (finite), or to value being finite without a tol."""
        if ok is None:
            ok = math.isfinite(value) and (tol is None or value <= tol)
        self.ok &= bool(ok)
        line = {"check": check, "value": value, "tol": tol, "ok": bool(ok), "detail": detail}
        print(json.dumps(line), flush=True)


def first(names: list[str]) -> str:
    """The first few offending names, for a failing check's detail."""
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def params_of(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.unwrapped_chunks[0].named_parameters()}


# -- checks ----------------------------------------------------------------------------------


def check_train(report: Report) -> None:
    engine = build()
    params = list(engine.unwrapped_chunks[0].parameters())
    wrong = [p for p in params if p.device != device() or p.dtype != torch.bfloat16]
    report.emit("train/params_bf16_on_device", float(len(wrong)), 0.0, detail=str(device()))
    before, main_before = params_of(engine), dict(optimizer_state(engine))
    batch = with_old_logprobs(engine, samples(seed=1))
    metrics = engine.train_step(batch, LossSettings("gspo"))
    report.emit("train/loss_finite", metrics["loss"])
    report.emit("train/grad_norm", metrics["grad_norm"], ok=0 < metrics["grad_norm"] < math.inf)
    report.emit("train/step_not_skipped", metrics["skipped"], 0.0)
    main_after = dict(optimizer_state(engine))
    main = [k for k in main_before if k.endswith(".main")]
    moved = sum(not torch.equal(main_before[k], main_after[k]) for k in main)
    after = params_of(engine)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    # Every fp32 main parameter moves (Adam with weight decay); a bf16 weight near 1 (the norms)
    # keeps its value when the update is below its spacing, 2^-7.
    report.emit(
        "train/weights_change",
        moved / len(main),
        ok=moved == len(main) and all("norm" in n for n in unchanged),
        detail=f"{moved} of {len(main)} fp32 main tensors moved; bf16 weights unchanged: "
        f"{len(unchanged)} (norms only: {all('norm' in n for n in unchanged)})",
    )
    # With advantage +1 every step raises the sampled sequences' log-probs (old = current, so
    # GSPO's ratio starts at 1 each step).
    engine = build(optimizer=OptimizerSettings(name="adam", lr=1e-2, weight_decay=0.0))
    batch = samples(seed=2)
    means = []
    for _ in range(4):
        train = with_old_logprobs(engine, batch, advantage=1.0)
        tokens = sum(len(s.response_ids) for s in train)
        means.append(sum(sum(s.old_logprobs) for s in train) / tokens)
        if len(means) < 4:
            engine.train_step(train, LossSettings("gspo"))
    report.emit(
        "train/logprob_rises_with_positive_advantage",
        means[-1] - means[0],
        ok=all(b > a for a, b in zip(means, means[1:], strict=False)),
        detail="mean response log-prob per step: " + ", ".join(f"{m:.4f}" for m in means),
    )


def check_generate(report: Report) -> None:
    engine = build()
    randomize(engine, seed=3)
    prompts = [s.prompt_ids for s in samples(seed=4, count=6)]
    params = SamplingParams(temperature=1.0, max_new_tokens=20, stop_token_ids=(), seed=5)
    for backend in ("auto", "megatron"):
        rollout = EmbeddedEngine(engine, record_routes=True, backend=backend, seed=0)
        name = f"generate[{rollout.decoder.name}]"
        groups = rollout.generate(prompts, 3, params)
        flat = [s for g in groups for s in g]
        lengths_ok = all(len(s.response_ids) == 20 for s in flat)
        in_vocab = all(0 <= t < VOCAB for s in flat for t in s.response_ids)
        report.emit(
            f"{name}/responses_complete",
            float(len(flat)),
            ok=len(flat) == 18 and lengths_ok and in_vocab,
            detail="6 prompts x 3 samples x 20 tokens, ids within the vocabulary",
        )
        replay = [
            TrainSample(s.prompt_ids, s.response_ids, routed_experts=s.routed_experts) for s in flat
        ]
        recomputed = engine.forward(replay, replay_routes=True).logprobs
        worst, mean, n = diff_stats([s.logprobs for s in flat], recomputed)
        report.emit(f"{name}/sampled_vs_recomputed_max", worst, LOGPROB_TOL, detail=f"{n} tokens")
        report.emit(f"{name}/sampled_vs_recomputed_mean", mean, LOGPROB_MEAN_TOL)
        if backend == "auto":
            # One unsplit model: the fast torch decoder, unless its start-up comparison with
            # GPTModel.forward (the engine's own bf16 bound, 5e-2) failed.
            diff = getattr(rollout, "torch_decoder_check", math.nan)
            report.emit(
                "generate/auto_picks_torch_decoder",
                float(diff),
                ok=rollout.decoder.name == "torch",
                detail=f"decoder {rollout.decoder.name}; value: its log-prob difference from "
                "GPTModel.forward at start-up",
            )
        rollout.close()


def check_export(report: Report) -> None:
    engine = build()
    randomize(engine, seed=6)
    source = MegatronWeightSource.from_engine(engine)
    exported, buckets = [], 0
    for bucket in source.buckets(64 * 1024):
        buckets += 1
        exported += bucket
    mapping = source.mapping
    names = [n for n, _ in exported]
    expected = {
        name: shape
        for entry in mapping.entries
        for name, shape in zip(entry.hf_names, _hf_shapes(entry), strict=True)
    }
    report.emit(
        "export/names_match_mapping",
        float(len(set(names) ^ set(expected)) + len(names) - len(set(names))),
        0.0,
        detail=f"{len(names)} tensors in {buckets} buckets",
    )
    bad_shape = [n for n, t in exported if tuple(t.shape) != tuple(expected.get(n, ()))]
    report.emit("export/shapes_match_mapping", len(bad_shape), 0.0, detail=first(bad_shape))
    off = [n for n, t in exported if t.device != device() or t.dtype != torch.bfloat16]
    report.emit("export/tensors_bf16_on_device", float(len(off)), 0.0, detail=first(off))

    # transformers on the exported weights, in float32 on the same device (bf16 values are exact
    # in float32), against the engine's bf16 forward: a bf16-vs-fp32 comparison.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    batch = samples(seed=7)
    ours = engine.forward(batch).logprobs
    with tempfile.TemporaryDirectory() as tmp:
        save_file({n: t.cpu() for n, t in exported}, f"{tmp}/model.safetensors")
        (Path(tmp) / "config.json").write_text(json.dumps(model_config("float32").to_hf()))
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device()).eval()
    theirs = []
    with torch.no_grad():
        for s in batch:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=device())
            logp = torch.log_softmax(hf(input_ids=ids).logits[0, :-1].float(), dim=-1)
            lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
            theirs.append(lp[len(s.prompt_ids) - 1 :].cpu())
    worst, mean, n = diff_stats(ours, theirs)
    detail = f"{n} tokens"
    report.emit("export/transformers_fp32_vs_engine_bf16_max", worst, LOGPROB_TOL, detail=detail)
    report.emit("export/transformers_fp32_vs_engine_bf16_mean", mean, LOGPROB_MEAN_TOL)


def _hf_shapes(entry) -> list[tuple[int, ...]]:
    if entry.kind == "vocab":
        return [tuple(export_shape(entry, VOCAB))]
    return [tuple(s) for s in entry.hf_shapes]


def optimizer_state(engine: TrainingEngine, copy: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The fp32 main parameters and Adam state (copies unless `copy=False`), in the optimizer's
    parameter order."""
    out = []
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                out.append((f"group{g}.{i}.main", p.detach().clone() if copy else p))
                for key, value in sorted(inner.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        out.append(
                            (f"group{g}.{i}.{key}", value.detach().clone() if copy else value)
                        )
    return out


def check_checkpoint(report: Report) -> None:
    adam = OptimizerSettings(
        name="adam", lr=1e-3, weight_decay=0.01, warmup_steps=1, decay_style="cosine"
    )
    saved = build(optimizer=adam)
    batch = with_old_logprobs(saved, samples(seed=8))
    for _ in range(2):
        saved.train_step(batch, LossSettings("gspo"))
    with tempfile.TemporaryDirectory() as tmp:
        checkpointing.save_engine(saved, Path(tmp) / "step2")
        loaded = build(optimizer=adam)
        randomize(loaded, seed=9)  # nothing of it may survive the load
        meta = checkpointing.load_engine(loaded, Path(tmp) / "step2")
    report.emit("checkpoint/steps_done", float(meta["steps_done"]), ok=meta["steps_done"] == 2)
    a, b = params_of(saved), params_of(loaded)
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    report.emit("checkpoint/weights_identical", float(len(differ)), 0.0, detail=first(differ))
    sa, sb = optimizer_state(saved), optimizer_state(loaded)
    differ = [na for (na, x), (_, y) in zip(sa, sb, strict=True) if not torch.equal(x, y)]
    report.emit(
        "checkpoint/optimizer_state_identical",
        float(len(differ) + abs(len(sa) - len(sb))),
        0.0,
        detail=f"{len(sa)} tensors (fp32 main params, exp_avg, exp_avg_sq, step) {first(differ)}",
    )
    report.emit("checkpoint/lr_identical", abs(saved.current_lr() - loaded.current_lr()), 0.0)
    m_saved = saved.train_step(batch, LossSettings("gspo"))
    m_loaded = loaded.train_step(batch, LossSettings("gspo"))
    a, b = params_of(saved), params_of(loaded)
    same = all(torch.equal(a[n], b[n]) for n in a) and m_saved["loss"] == m_loaded["loss"]
    report.emit(
        "checkpoint/next_step_identical",
        abs(m_saved["grad_norm"] - m_loaded["grad_norm"]),
        ok=same and m_saved["grad_norm"] == m_loaded["grad_norm"],
        detail="weights, loss and gradient norm of step 3",
    )


def allocated_bytes(engine: TrainingEngine) -> int:
    """The allocator's figure on a GPU; on CPU (gpu_check --allow-cpu) the engine's storages."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    tensors = [p for chunk in engine.unwrapped_chunks for p in chunk.parameters()]
    tensors += [b.grad_data for m in engine.model for b in (*m.buffers, *m.expert_parallel_buffers)]
    tensors += [t for _, t in optimizer_state(engine, copy=False)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def check_offload(report: Report) -> None:
    """trainer.offload_during_rollout=all on the GPU: what leaves the allocator against the
    memory planner's figure (parameters exact; DDP pads its buffers a little), and training with
    offloads between steps bitwise identical to training without."""
    from gspo_megatron.memory_plan import PlanSettings, plan
    from gspo_megatron.rollout.backends import RolloutShare

    adam = OptimizerSettings(name="adam", lr=1e-3, weight_decay=0.01)
    engines = [build(optimizer=adam), build(optimizer=adam)]
    for engine in engines:
        randomize(engine, seed=11)
    batch = with_old_logprobs(engines[0], samples(seed=12))
    metrics: list[list[tuple[float, float]]] = [[], []]
    freed_gib = []
    for _ in range(3):
        for k, engine in enumerate(engines):
            m = engine.train_step(batch, LossSettings("gspo"))
            metrics[k].append((m["loss"], m["grad_norm"]))
        before = allocated_bytes(engines[0])
        engines[0].offload("all", keep_weights=False)
        freed_gib.append((before - allocated_bytes(engines[0])) / 2**30)
        engines[0].reload()
    memory = plan(
        model_config("bfloat16"),
        ParallelLayout(),
        PlanSettings(
            micro_batch_tokens=256,
            rollout=RolloutShare(server_fraction=0.5),
            offload_during_rollout="all",
        ),
    )
    expected = memory.stages[0].offloaded
    report.emit(
        "offload/freed_vs_planner_rel",
        abs(freed_gib[-1] - expected) / expected,
        0.1,
        detail=f"allocator freed {freed_gib[-1]:.4f} GiB, planner {expected:.4f} GiB",
    )
    a, b = params_of(engines[0]), params_of(engines[1])
    same = all(torch.equal(a[n], b[n]) for n in a)
    sa, sb = optimizer_state(engines[0]), optimizer_state(engines[1])
    same_state = all(torch.equal(x, y) for (_, x), (_, y) in zip(sa, sb, strict=True))
    report.emit(
        "offload/training_bitwise_identical",
        float(not (same and same_state and metrics[0] == metrics[1])),
        0.0,
        detail="weights, fp32 main parameters, Adam state, loss and gradient norm of 3 steps",
    )


def check_logprobs(report: Report, reference: Path) -> None:
    ref = torch.load(reference / "reference.pt", weights_only=False)
    engine = build()
    checkpointing.load_engine(engine, reference / "ckpt", with_optimizer=False, restore_rng=False)
    batch = [
        TrainSample(p, r, routed_experts=routes)
        for p, r, routes in zip(ref["prompts"], ref["responses"], ref["routes"], strict=True)
    ]
    replayed = engine.forward(batch, replay_routes=True).logprobs
    worst, mean, n = diff_stats(replayed, ref["logprobs"])
    where = f"{device()} bf16 vs CPU fp32, {n} tokens, CPU routes replayed"
    report.emit("logprobs/bf16_vs_cpu_fp32_max", worst, LOGPROB_TOL, detail=where)
    report.emit("logprobs/bf16_vs_cpu_fp32_mean", mean, LOGPROB_MEAN_TOL)
    cpu_bf16 = ref["cpu_bf16_vs_fp32"]
    report.emit(
        "logprobs/cpu_bf16_vs_cpu_fp32_max (for scale)",
        cpu_bf16[0],
        ok=True,
        detail=f"mean {cpu_bf16[1]:.2e}: the same comparison with bf16 on CPU",
    )
    free = engine.forward(batch, record_routes=True)
    worst_free, mean_free, _ = diff_stats(free.logprobs, ref["logprobs"])
    flips = route_flips(free.routes, ref["routes"])
    report.emit(
        "logprobs/own_routing_mean (information)",
        mean_free,
        ok=True,
        detail=f"max {worst_free:.3f}; {flips} token-layer routes differ from fp32's",
    )


def cpu_reference(out: Path) -> None:
    """fp32 weights (checkpoint), fp32 log-probs and routes on CPU; bf16-on-CPU for scale."""
    out.mkdir(parents=True, exist_ok=True)
    engine = build("float32")
    randomize(engine, seed=10)
    checkpointing.save_engine(engine, out / "ckpt", with_optimizer=False)
    batch = samples(seed=11, count=16)
    result = engine.forward(batch, record_routes=True)
    bf16 = build("bfloat16")
    checkpointing.load_engine(bf16, out / "ckpt", with_optimizer=False, restore_rng=False)
    replay = [
        TrainSample(s.prompt_ids, s.response_ids, routed_experts=r)
        for s, r in zip(batch, result.routes, strict=True)
    ]
    worst, mean, _ = diff_stats(bf16.forward(replay, replay_routes=True).logprobs, result.logprobs)
    torch.save(
        {
            "prompts": [s.prompt_ids for s in batch],
            "responses": [s.response_ids for s in batch],
            "logprobs": result.logprobs,
            "routes": result.routes,
            "cpu_bf16_vs_fp32": (worst, mean),
        },
        out / "reference.pt",
    )
    print(json.dumps({"cpu_reference": str(out), "cpu_bf16_vs_fp32": [worst, mean]}), flush=True)


def measure_bf16(seeds: int) -> None:
    """The distribution behind LOGPROB_TOL: |bf16 - fp32| log-probs on this machine over
    `seeds` weight draws x 16 sequences, fp32 routes replayed (and, for information, without)."""
    fp32, bf16 = build("float32"), build("bfloat16")
    replayed, free, flips, spread = [], [], 0, []  # |Δ| per token, own routing, routes, fp32
    for seed in range(seeds):
        for engine in (fp32, bf16):
            randomize(engine, seed=100 + seed)
        batch = samples(seed=200 + seed, count=16)
        ref = fp32.forward(batch, record_routes=True)
        spread += [float(x) for lp in ref.logprobs for x in lp]
        replay = [
            TrainSample(s.prompt_ids, s.response_ids, routed_experts=r)
            for s, r in zip(batch, ref.routes, strict=True)
        ]
        got = bf16.forward(replay, replay_routes=True).logprobs
        replayed += token_diffs(got, ref.logprobs).tolist()
        own = bf16.forward(batch, record_routes=True)
        free += token_diffs(own.logprobs, ref.logprobs).tolist()
        flips += route_flips(own.routes, ref.routes)

    def quantiles(values: list[float]) -> dict[str, float]:
        t = torch.tensor(values, dtype=torch.float64)
        qs = torch.quantile(t, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
        return {"n": len(values), "median": qs[0], "p99": qs[1], "p999": qs[2],
                "max": float(t.max()), "mean": float(t.mean())}  # fmt: skip

    lp = torch.tensor(spread)
    print(json.dumps({
        "replayed": quantiles(replayed), "own_routing": quantiles(free), "route_flips": flips,
        "fp32_logprob_range": [float(lp.min()), float(lp.median()), float(lp.max())],
    }), flush=True)  # fmt: skip


CHECKS = ("train", "generate", "export", "checkpoint", "offload", "logprobs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default="", help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--reference", type=Path, help="a --cpu-reference directory (logprobs)")
    parser.add_argument("--cpu-reference", type=Path, help="write the fp32 CPU reference here")
    parser.add_argument("--allow-cpu", action="store_true", help="run the checks without CUDA")
    parser.add_argument("--measure-bf16", type=int, metavar="SEEDS", help="bf16 error statistics")
    args = parser.parse_args(argv)
    parallel.initialize(ParallelLayout(), seed=1234)
    if args.cpu_reference:
        if torch.cuda.is_available():
            raise SystemExit("gpu_worker: run --cpu-reference with CUDA_VISIBLE_DEVICES=")
        cpu_reference(args.cpu_reference)
        parallel.destroy()
        return 0
    if args.measure_bf16:
        measure_bf16(args.measure_bf16)
        parallel.destroy()
        return 0
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("gpu_worker: no CUDA device (--allow-cpu runs the checks on CPU)")
    report = Report()
    names = [c for c in args.checks.split(",") if c]
    unknown = set(names) - set(CHECKS)
    if unknown or not names:
        raise SystemExit(f"gpu_worker: --checks takes some of {CHECKS}, got {args.checks!r}")
    if "logprobs" in names and not args.reference:
        raise SystemExit("gpu_worker: the logprobs check needs --reference DIR (--cpu-reference)")
    run = {
        "train": lambda: check_train(report),
        "generate": lambda: check_generate(report),
        "export": lambda: check_export(report),
        "checkpoint": lambda: check_checkpoint(report),
        "offload": lambda: check_offload(report),
        "logprobs": lambda: check_logprobs(report, args.reference),
    }
    for name in names:
        parallel.seed_everything(1234)
        try:
            run[name]()
        except Exception as err:  # report it and go on: one broken path must not hide others
            traceback.print_exc()
            report.emit(f"{name}/raised", math.nan, ok=False, detail=f"{type(err).__name__}: {err}")
    parallel.destroy()
    return 0 if report.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
