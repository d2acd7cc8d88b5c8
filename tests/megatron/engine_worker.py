"""Engine checks that need megatron in a process of their own (see test_engine.py).

Modes (`--mode`), each printing JSON lines {"check", "value", "ok"} on rank 0:
- gradient:      the in-schedule loss's gradient vs autograd through the algorithms library's
                 policy_loss on the same model's log-probs (single process).
- replay:        routing replay R2/R3 and the route-change fraction.
- resume:        Adam + distributed optimizer: save after step 1, resume, step 2 equals an
                 uninterrupted step 2 (any DP size).
- lora-resume:   the same with LoRA adapters (two steps before the save, so that A has moved
                 too): resumed exactly; Adam's state holds the adapters' elements and no more
                 (summed over the data-parallel shards); the checkpoint refused by an engine
                 without adapters or with other ones, naming both.
- lora-init-from: a LoRA engine starting from an HF directory and from a full-weight
                 checkpoint gets their base weights and its fresh adapters: log-probs bitwise
                 those of an engine without adapters loading the same; a LoRA checkpoint as
                 initial weights refused.
- save-layout:   train one Adam step on the current layout, save, record log-probs.
- load-layout:   load that checkpoint on the current layout, compare log-probs.
- nonfinite:     a non-finite gradient is skipped (weights untouched) or raises.
- bad-input:     clear errors for too-long sequences, empty responses, other architectures.
- grad-sync:     the gradient sync's one-process shortcut is taken in one process only, and
                 trains exactly as megatron's finalize_model_grads (weights and gradient norms
                 bitwise); over several ranks the engine keeps megatron's, and the shortcut
                 there would train otherwise (the sync it leaves out is needed).
- offload:       training with the state offloaded between steps is bitwise identical to
                 training without (weights, Adam state, metrics); offloading frees the chosen
                 storages; a checkpoint saved while offloaded resumes exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from layout_text import parse_layout

from gspo_megatron.algorithms import policy_loss
from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.training_engine import (
    NonFiniteError,
    TrainingEngine,
    _finalize_one_process,
)
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import load_preset
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

VOCAB = 48
RESULTS: list[tuple[str, float, bool]] = []


def check(name: str, value: float, ok: bool) -> None:
    RESULTS.append((name, float(value), bool(ok)))


def samples(seed: int = 3, count: int = 8, max_response: int = 12) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))]
        response = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_response))]
        out.append(TrainSample(prompt, response, advantage=rng.gauss(0.0, 1.0)))
    return out


def engine_for(
    layout: ParallelLayout,
    *,
    optimizer: OptimizerSettings,
    aux: float = 0.0,
    tokens: int = 64,
    lora: LoRASettings | None = None,
    **engine_kw,
) -> TrainingEngine:
    model = load_preset("tiny_moe")
    settings = EngineSettings(max_sequence_length=40, max_tokens_per_microbatch=tokens, **engine_kw)
    aux_loss = {"moe_aux_loss": "aux_loss", "moe_aux_loss_coef": aux} if aux else {}
    return TrainingEngine(
        model, layout, settings, optimizer, decay_steps=10, lora=lora, lora_seed=3, **aux_loss
    )


def with_old(batch, logprobs, scale=0.05, seed=5):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s, lp in zip(batch, logprobs, strict=True):
        old = torch.as_tensor(lp, dtype=torch.float64) + scale * torch.randn(
            len(lp), generator=gen, dtype=torch.float64
        )
        out.append(
            TrainSample(s.prompt_ids, s.response_ids, s.advantage, old_logprobs=old.tolist())
        )
    return out


SGD = OptimizerSettings(
    name="sgd", lr=1.0, clip_grad=0.0, weight_decay=0.0, distributed_optimizer=False
)
ADAM = OptimizerSettings(
    name="adam",
    lr=1e-2,
    clip_grad=1.0,
    weight_decay=0.01,
    distributed_optimizer=True,
    warmup_steps=1,
    decay_style="cosine",
)  # the engines below decay over 10 optimizer steps


def mode_gradient(layout: ParallelLayout) -> None:
    for name, hp, entropy_coef in (
        ("gspo", {"clip_low": 0.02, "clip_high": 0.02}, 0.0),
        ("grpo", {}, 0.0),
        ("gspo_token", {"clip_low": 0.02, "clip_high": 0.02}, 0.0),
        ("ppo", {}, 0.1),  # an entropy bonus: its gradient through the vocabulary's softmax
    ):
        engine = engine_for(layout, optimizer=SGD, tokens=40)
        batch = samples()
        train = with_old(batch, engine.forward(batch).logprobs)
        model = engine.unwrapped_chunks[0]
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        # Reference: plain autograd through the full-vocabulary log-softmax, then policy_loss
        # over a [B, T] response-aligned padding, all on one batch.
        longest = max(s.length for s in train)
        tokens = torch.zeros(len(train), longest, dtype=torch.long)
        for i, s in enumerate(train):
            tokens[i, : s.length] = torch.tensor(s.prompt_ids + s.response_ids)
        positions = torch.arange(longest).expand(len(train), longest)
        model.zero_grad()
        logits = model(tokens, positions, None)[..., :VOCAB].double()
        logp_all = torch.log_softmax(logits, dim=-1)
        t_max = max(len(s.response_ids) for s in train)
        lp = torch.zeros(len(train), t_max, dtype=torch.float64)
        old = torch.zeros_like(lp)
        mask = torch.zeros_like(lp)
        lp_rows, entropy_rows = [], []
        for i, s in enumerate(train):
            start = len(s.prompt_ids) - 1
            n = len(s.response_ids)
            idx = torch.tensor(s.response_ids)
            rows = logp_all[i, start : start + n]
            lp_rows.append(rows.gather(1, idx[:, None]).squeeze(1))
            entropy_rows.append(-(rows.exp() * rows).sum(-1))
            old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float64)
            mask[i, :n] = 1.0

        lp, entropy = (
            torch.stack([torch.nn.functional.pad(r, (0, t_max - len(r))) for r in rows])
            for rows in (lp_rows, entropy_rows)
        )
        adv = torch.tensor([s.advantage for s in train], dtype=torch.float64)
        bonus = {"entropy": entropy, "entropy_coef": entropy_coef}
        ref_loss, _ = policy_loss(name, lp, old, adv, mask, **hp, **bonus)
        grads = torch.autograd.grad(
            ref_loss, [p for _, p in model.named_parameters()], allow_unused=True
        )
        reference = dict(zip([k for k, _ in model.named_parameters()], grads, strict=True))
        metrics = engine.train_step(train, LossSettings(name, hp, entropy_coef=entropy_coef))
        worst = 0.0
        largest = 0.0
        for key, param in model.named_parameters():
            grad = reference[key]
            got = before[key] - param.detach()  # SGD, lr 1: the applied gradient
            want = torch.zeros_like(got) if grad is None else grad.float()
            largest = max(largest, float(want.abs().max()))
            worst = max(worst, float((got - want).abs().max()))
        check(
            f"{name}_loss_vs_policy_loss",
            abs(metrics["loss"] - float(ref_loss)),
            abs(metrics["loss"] - float(ref_loss)) <= 1e-6,
        )
        check(f"{name}_grad_max_abs_diff_rel", worst / largest, worst / largest <= 1e-4)
        check(f"{name}_grad_nonzero", largest, largest > 0)


def mode_replay(layout: ParallelLayout) -> None:
    engine = engine_for(
        layout,
        optimizer=OptimizerSettings(
            name="sgd", lr=30.0, clip_grad=0.0, weight_decay=0.01, distributed_optimizer=False
        ),
    )
    batch = samples()
    first = engine.forward(batch, record_routes=True)
    routes = first.routes
    n_layers = engine.model_config.num_hidden_layers
    top_k = engine.model_config.num_experts_per_tok
    shapes_ok = all(
        r.shape == (s.length - 1, n_layers, top_k) for r, s in zip(routes, batch, strict=True)
    )
    check("routes_shape", float(shapes_ok), shapes_ok)
    replayed_input = [
        TrainSample(s.prompt_ids, s.response_ids, s.advantage, routed_experts=r)
        for s, r in zip(batch, routes, strict=True)
    ]
    again = engine.forward(replayed_input, record_routes=True, replay_routes=True)
    same_routes = all(
        (
            torch.sort(torch.as_tensor(a), -1).values == torch.sort(torch.as_tensor(b), -1).values
        ).all()
        for a, b in zip(routes, again.routes, strict=True)
    )
    check("replay_reproduces_recorded_routes", float(same_routes), same_routes)
    # With the weights unchanged, each router's own top-k equals the replayed one everywhere.
    natural = engine.routes.step_metrics().get("moe/route_change_fraction", -1.0)
    check("replay_matches_router_choice_same_weights", natural, natural == 0.0)
    lp_diff = max(
        float(abs(a - b).max()) for a, b in zip(first.logprobs, again.logprobs, strict=True)
    )
    check("replay_same_logprobs_same_weights", lp_diff, lp_diff <= 1e-6)
    # A large update changes some routes: measured against the old routes without replay ...
    train = [
        TrainSample(
            s.prompt_ids, s.response_ids, s.advantage, old_logprobs=list(lp), routed_experts=r
        )
        for s, lp, r in zip(batch, first.logprobs, routes, strict=True)
    ]
    engine.train_step(train, LossSettings("grpo"))
    after = engine.train_step(train, LossSettings("grpo"))
    change = after.get("moe/route_change_fraction", 0.0)
    check("route_change_fraction_without_replay", change, change > 0)
    # ... and while replaying (the router's own choice is still measured).
    replayed = engine.train_step(train, LossSettings("grpo"), replay_routes=True)
    change_replayed = replayed.get("moe/route_change_fraction", 0.0)
    check("route_change_fraction_with_replay", change_replayed, change_replayed > 0)
    forced = engine.forward(train, record_routes=True, replay_routes=True)
    forced_same = all(
        (
            torch.sort(torch.as_tensor(a), -1).values == torch.sort(torch.as_tensor(b), -1).values
        ).all()
        for a, b in zip(routes, forced.routes, strict=True)
    )
    check("replay_after_update_uses_old_routes", float(forced_same), forced_same)


def mode_resume(layout: ParallelLayout, workdir: Path) -> None:
    batch = samples()
    straight = engine_for(layout, optimizer=ADAM, aux=0.01)
    train = with_old(batch, straight.forward(batch).logprobs)
    m1 = straight.train_step(train, LossSettings("gspo"))
    checkpointing.save_engine(straight, workdir / "step1")
    m2 = straight.train_step(train, LossSettings("gspo"))
    resumed = engine_for(layout, optimizer=ADAM, aux=0.01)
    meta = checkpointing.load_engine(resumed, workdir / "step1")
    check("resume_steps_done", meta["steps_done"], meta["steps_done"] == 1)
    check("resume_lr_restored", resumed.current_lr(), resumed.current_lr() == m1["lr"])
    r2 = resumed.train_step(train, LossSettings("gspo"))
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(
            straight.unwrapped_chunks[0].parameters(),
            resumed.unwrapped_chunks[0].parameters(),
            strict=True,
        )
    )
    diff_t = torch.tensor([diff])
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    check("resume_params_identical", float(diff_t), float(diff_t) == 0.0)
    check("resume_loss_identical", abs(m2["loss"] - r2["loss"]), m2["loss"] == r2["loss"])
    check(
        "resume_grad_norm_identical",
        abs(m2["grad_norm"] - r2["grad_norm"]),
        m2["grad_norm"] == r2["grad_norm"],
    )
    check("lr_schedule_moves", m2["lr"], m2["lr"] != m1["lr"])


def mode_grad_sync(layout: ParallelLayout) -> None:
    from functools import partial

    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    batch = samples()
    chosen = engine_for(layout, optimizer=ADAM, aux=0.01)
    alone = dist.get_world_size() == 1
    shortcut = chosen.config.finalize_model_grads_func is not finalize_model_grads
    check("grad_sync_shortcut_only_in_one_process", float(shortcut), shortcut == alone)

    def same_start(finalize) -> TrainingEngine:
        engine = engine_for(layout, optimizer=ADAM, aux=0.01)
        for mine, theirs in zip(engine.unwrapped_chunks, chosen.unwrapped_chunks, strict=True):
            mine.load_state_dict(theirs.state_dict())
        engine.optimizer.reload_model_params()
        engine.config.finalize_model_grads_func = finalize
        return engine

    megatron = same_start(finalize_model_grads)
    groups = [g for m in megatron.model for g in m.bucket_groups + m.expert_parallel_bucket_groups]
    forced = same_start(partial(_finalize_one_process, groups))
    train = with_old(batch, chosen.forward(batch).logprobs)
    norms = {name: [] for name in ("chosen", "megatron", "forced")}
    for _ in range(2):
        for name, engine in (("chosen", chosen), ("megatron", megatron), ("forced", forced)):
            norms[name].append(engine.train_step(train, LossSettings("gspo"))["grad_norm"])

    def weight_diff(engine) -> float:
        diff = max(
            float((a - b).abs().max())
            for a, b in zip(
                chosen.unwrapped_chunks[0].parameters(),
                engine.unwrapped_chunks[0].parameters(),
                strict=True,
            )
        )
        diff_t = torch.tensor([diff])
        dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
        return float(diff_t)

    diff = weight_diff(megatron)
    check("grad_sync_weights_as_megatron", diff, diff == 0.0)
    check("grad_sync_grad_norms_as_megatron", 0.0, norms["chosen"] == norms["megatron"])
    if not alone:
        diff = weight_diff(forced)
        check("grad_sync_shortcut_would_differ_over_ranks", diff, diff > 0.0)


def mode_lora_resume(layout: ParallelLayout, workdir: Path) -> None:
    from gspo_megatron.megatron.checkpointing import _sub_optimizers
    from gspo_megatron.megatron.lora import adapted_layers

    lora = LoRASettings(rank=4, alpha=8.0)
    batch = samples()
    straight = engine_for(layout, optimizer=ADAM, lora=lora)
    train = with_old(batch, straight.forward(batch).logprobs)
    for _ in range(2):
        straight.train_step(train, LossSettings("gspo"))
    checkpointing.save_engine(straight, workdir / "lora_step2")
    m3 = straight.train_step(train, LossSettings("gspo"))
    resumed = engine_for(layout, optimizer=ADAM, lora=lora)
    meta = checkpointing.load_engine(resumed, workdir / "lora_step2")
    check("lora_resume_steps_done", meta["steps_done"], meta["steps_done"] == 2)
    r3 = resumed.train_step(train, LossSettings("gspo"))
    diff = torch.tensor([max(
        float((a - b).abs().max())
        for a, b in zip(
            straight.unwrapped_chunks[0].state_dict().values(),
            resumed.unwrapped_chunks[0].state_dict().values(),
            strict=True,
        )
        if torch.is_tensor(a)
    )])  # fmt: skip
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    check("lora_resume_weights_identical", float(diff), float(diff) == 0.0)
    same = (m3["loss"], m3["grad_norm"]) == (r3["loss"], r3["grad_norm"])
    check("lora_resume_loss_and_grad_norm_identical", abs(m3["loss"] - r3["loss"]), same)
    moved = max(
        float(layer.lora_b.abs().max()) for _, layer in adapted_layers(resumed.unwrapped_chunks)
    )
    check("lora_b_trained_from_zero", moved, moved > 0)
    state = sum(
        s["exp_avg"].numel()
        for sub in _sub_optimizers(resumed.optimizer)
        for s in sub.optimizer.state.values()
    )
    state_t = torch.tensor([float(state)])
    dist.all_reduce(state_t)
    adapters = sum(
        p.numel()
        for _, layer in adapted_layers(resumed.unwrapped_chunks)
        for p in (layer.lora_a, layer.lora_b)
    )
    total = sum(p.numel() for p in resumed.unwrapped_chunks[0].parameters())
    check("lora_adam_state_elements_minus_adapters", float(state_t) - adapters,
          float(state_t) == adapters and adapters < total / 5)  # fmt: skip
    full = engine_for(layout, optimizer=ADAM)
    expect_error(
        "lora_checkpoint_into_full_engine",
        lambda: checkpointing.load_engine(full, workdir / "lora_step2"),
        "the checkpoint holds LoRA adapters of lora.rank=4",
    )
    other = engine_for(layout, optimizer=ADAM, lora=LoRASettings(rank=2, alpha=8.0))
    expect_error(
        "lora_checkpoint_into_other_rank",
        lambda: checkpointing.load_engine(other, workdir / "lora_step2"),
        "the engine has LoRA adapters of lora.rank=2",
    )
    expect_error(
        "lora_checkpoint_weights_without_adapters",
        lambda: checkpointing.load_model_weights(full.unwrapped_chunks, workdir / "lora_step2"),
        "holds LoRA adapters (lora.rank=4): loading its base weights alone would drop them",
    )
    for engine in (straight, resumed, full, other):
        engine.close()


def mode_lora_init_from(layout: ParallelLayout, workdir: Path) -> None:
    from launch import hf_policy

    from gspo_megatron.megatron.weight_loading import load_engine_weights

    lora = LoRASettings(rank=4, alpha=8.0)
    batch = samples()
    hf = hf_policy(workdir / "hf") if dist.get_rank() == 0 else workdir / "hf"
    dist.barrier()
    full = engine_for(layout, optimizer=ADAM)
    load_engine_weights(full, hf)
    expected = full.forward(batch).logprobs
    checkpointing.save_engine(full, workdir / "full_weights", with_optimizer=False)
    engines = [full]
    for name, source in (("hf", hf), ("checkpoint", workdir / "full_weights")):
        adapted = engine_for(layout, optimizer=ADAM, lora=lora)
        engines.append(adapted)
        load_engine_weights(adapted, source)
        got = adapted.forward(batch).logprobs
        pairs = zip(got, expected, strict=True)
        same = all((torch.as_tensor(a) == torch.as_tensor(b)).all() for a, b in pairs)
        check(f"lora_init_from_{name}_bitwise_base", float(not same), same)
    adapted.train_step(with_old(batch, got), LossSettings("gspo"))
    checkpointing.save_engine(adapted, workdir / "lora_weights", with_optimizer=False)
    again = engine_for(layout, optimizer=ADAM, lora=lora)
    expect_error(
        "lora_checkpoint_as_initial_weights",
        lambda: load_engine_weights(again, workdir / "lora_weights"),
        "holds LoRA adapters (lora.rank=4): loading its base weights alone would drop them",
    )
    for engine in (*engines, again):
        engine.close()


def engine_state(engine) -> list[torch.Tensor]:
    """Every weight and optimizer-state tensor of the engine, in a fixed order (copies)."""
    tensors = [p.detach().clone() for chunk in engine.unwrapped_chunks for p in chunk.parameters()]
    for part in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for state in part.optimizer.state.values():
            tensors += [
                state[k].detach().clone() for k in sorted(state) if torch.is_tensor(state[k])
            ]
    return tensors


def freed(tensors) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


def optimizer_state_tensors(engine) -> list[torch.Tensor]:
    return [
        v
        for part in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        for state in part.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]


def mode_offload(layout: ParallelLayout, workdir: Path) -> None:
    batch = samples()
    engine = engine_for(layout, optimizer=ADAM)
    train = with_old(batch, engine.forward(batch).logprobs)
    engine.train_step(train, LossSettings("gspo"))  # Adam's state exists from the first step
    checkpointing.save_engine(engine, workdir / "offload_init")
    runs = {}
    for what in ("none", "optimizer", "all"):
        checkpointing.load_engine(engine, workdir / "offload_init")
        metrics = []
        for _ in range(3):
            metrics.append(engine.train_step(train, LossSettings("gspo")))
            if what == "none":
                continue
            moved = engine.offload(what, keep_weights=what == "optimizer")
            weights = [p for chunk in engine.unwrapped_chunks for p in chunk.parameters()]
            grads = [
                b.grad_data for m in engine.model for b in (*m.buffers, *m.expert_parallel_buffers)
            ]
            state_freed = freed(optimizer_state_tensors(engine))
            check(f"offload_{what}_frees_optimizer_state", float(state_freed), state_freed)
            if what == "all":
                gone = freed(weights) and freed(grads)
                check("offload_all_frees_weights_and_gradients", float(gone), gone)
            else:
                kept = not any(t.untyped_storage().nbytes() == 0 for t in weights + grads)
                check("offload_optimizer_keeps_weights_and_gradients", float(kept), kept)
            check(f"offload_{what}_bytes", moved["offload_bytes"], moved["offload_bytes"] > 0)
            engine.reload()
        runs[what] = (engine_state(engine), [(m["loss"], m["grad_norm"]) for m in metrics])
    for what in ("optimizer", "all"):
        same_state = all(
            torch.equal(a, b) for a, b in zip(runs[what][0], runs["none"][0], strict=True)
        ) and len(runs[what][0]) == len(runs["none"][0])
        flag = torch.tensor([0.0 if same_state else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        check(f"offload_{what}_state_bitwise_identical", float(flag), float(flag) == 0.0)
        same = runs[what][1] == runs["none"][1]
        check(f"offload_{what}_metrics_identical", float(not same), same)
    # Saved while offloaded: the checkpoint holds the state itself.
    checkpointing.load_engine(engine, workdir / "offload_init")
    engine.train_step(train, LossSettings("gspo"))
    engine.offload("all", keep_weights=False)
    checkpointing.save_engine(engine, workdir / "offload_saved")
    straight = engine.train_step(train, LossSettings("gspo"))
    checkpointing.load_engine(engine, workdir / "offload_saved")
    resumed = engine.train_step(train, LossSettings("gspo"))
    same = (straight["loss"], straight["grad_norm"]) == (resumed["loss"], resumed["grad_norm"])
    check("offload_saved_checkpoint_resumes_exactly", float(not same), same)
    try:
        engine.offload("optimizer", keep_weights=True)
        engine.train_step(train, LossSettings("gspo"))
        check("offload_train_while_offloaded_refused", 1.0, False)
    except RuntimeError as err:
        ok = "offloaded" in str(err)
        check("offload_train_while_offloaded_refused", float(ok), ok)
    engine.reload()


def mode_save_layout(layout: ParallelLayout, workdir: Path) -> None:
    engine = engine_for(layout, optimizer=ADAM)
    batch = samples()
    train = with_old(batch, engine.forward(batch).logprobs)
    engine.train_step(train, LossSettings("gspo"))
    checkpointing.save_engine(engine, workdir / "trained")
    logprobs = engine.forward(batch).logprobs
    if dist.get_rank() == 0:
        torch.save([torch.as_tensor(x) for x in logprobs], workdir / "trained_logprobs.pt")
    check("saved", 1.0, True)


def mode_load_layout(layout: ParallelLayout, workdir: Path) -> None:
    engine = engine_for(layout, optimizer=ADAM)
    checkpointing.load_engine(engine, workdir / "trained", with_optimizer=False)
    logprobs = engine.forward(samples()).logprobs
    expected = torch.load(workdir / "trained_logprobs.pt")
    diff = max(
        float((torch.as_tensor(a) - b).abs().max()) for a, b in zip(logprobs, expected, strict=True)
    )
    check("loaded_logprobs_max_abs_diff", diff, diff <= 1e-5)
    if engine.layout.ep == 1:
        try:
            checkpointing.load_engine(engine, workdir / "trained", with_optimizer=True)
            raised = ""
        except checkpointing.CheckpointError as err:
            raised = str(err)
        check(
            "optimizer_across_ep_refused",
            float("parallel.ep=2" in raised),
            "parallel.ep=2" in raised,
        )


def mode_nonfinite(layout: ParallelLayout) -> None:
    for policy in ("skip", "raise"):
        engine = engine_for(layout, optimizer=SGD, nonfinite=policy)
        batch = samples()
        train = with_old(batch, engine.forward(batch).logprobs)
        model = engine.unwrapped_chunks[0]
        with torch.no_grad():
            model.output_layer.weight[3, 0] = math.inf
        before = [p.detach().clone() for p in model.parameters()]
        try:
            metrics = engine.train_step(train, LossSettings("gspo"))
        except NonFiniteError as err:
            check(f"nonfinite_{policy}", 1.0, policy == "raise" and "engine.nonfinite" in str(err))
            continue
        untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        check(
            f"nonfinite_{policy}",
            metrics["skipped"],
            policy == "skip" and metrics["skipped"] == 1.0 and untouched,
        )


def mode_bad_input(layout: ParallelLayout, workdir: Path) -> None:
    engine = engine_for(layout, optimizer=SGD)
    too_long = [TrainSample(list(range(30)), list(range(20)), 1.0, old_logprobs=[0.0] * 20)]
    expect_error(
        "too_long",
        lambda: engine.train_step(too_long, LossSettings()),
        "engine.max_sequence_length",
    )
    empty = [TrainSample([1, 2], [], 1.0, old_logprobs=[])]
    expect_error("empty_response", lambda: engine.forward(empty), "empty response")
    no_old = [TrainSample([1, 2], [3], 1.0)]
    expect_error(
        "missing_old_logprobs", lambda: engine.train_step(no_old, LossSettings()), "old_logprobs"
    )
    checkpointing.save_engine(engine, workdir / "tiny", with_optimizer=False)
    other = TrainingEngine(
        load_preset("tiny_moe", hidden_size=32), layout, EngineSettings(max_sequence_length=40), SGD
    )
    expect_error(
        "other_architecture",
        lambda: checkpointing.load_engine(other, workdir / "tiny", with_optimizer=False),
        "model.hidden_size=64",
    )
    expect_error(
        "missing_checkpoint",
        lambda: checkpointing.load_engine(engine, workdir / "nowhere"),
        "not a gspo-megatron checkpoint",
    )


def expect_error(name: str, fn, fragment: str) -> None:
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        check(f"error_{name}", 1.0, fragment in str(err))
        if fragment not in str(err):
            print(f"unexpected message for {name}: {err}", file=sys.stderr)
        return
    check(f"error_{name}", 0.0, False)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--layout", default="")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    layout = parse_layout(args.layout, parallel.world_size_from_env())
    parallel.initialize(layout, seed=1234)
    modes = {
        "gradient": lambda: mode_gradient(layout),
        "replay": lambda: mode_replay(layout),
        "resume": lambda: mode_resume(layout, args.workdir),
        "lora-resume": lambda: mode_lora_resume(layout, args.workdir),
        "lora-init-from": lambda: mode_lora_init_from(layout, args.workdir),
        "save-layout": lambda: mode_save_layout(layout, args.workdir),
        "load-layout": lambda: mode_load_layout(layout, args.workdir),
        "nonfinite": lambda: mode_nonfinite(layout),
        "bad-input": lambda: mode_bad_input(layout, args.workdir),
        "offload": lambda: mode_offload(layout, args.workdir),
        "grad-sync": lambda: mode_grad_sync(layout),
    }
    for mode in args.mode.split(","):
        modes[mode]()
    ok = all(passed for _, _, passed in RESULTS)
    if dist.get_rank() == 0:
        for name, value, passed in RESULTS:
            print(json.dumps({"check": name, "value": value, "ok": passed}), flush=True)
    parallel.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
