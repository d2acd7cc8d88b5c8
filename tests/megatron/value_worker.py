"""Run under torchrun: the value engine (PPO's critic) on one parallel layout, compared with a
one-process reference.

`--make-reference DIR --model NAME` (one process, one padded micro-batch) sets the value head
from a seeded generator (its zero init would leave the trunk without gradient) and checks the
engine against computations of its own: values against the final-norm hidden states of
megatron's own chunk (each sample alone, the head taken off) dotted with the head in float64;
the gradient of each of two SGD steps (the `main_grad` the optimizer applied) against autograd
through the clipped value loss written out here in float64; the loss, clip fraction and
explained variance against the same; and the refusals (a frozen engine, a policy engine, a
value engine asked for a policy step). It writes DIR/NAME: the initial weights, the values, and
for each step the metrics, the weights after it, its gradient (saved as a weights checkpoint,
so that every layout reads it back in its own sharding) and the values after it.

`--ref-dir DIR --layout [NAME:]LAYOUT` loads those initial weights on the layout, checks the head
it loaded is the seeded one, cuts the same batch into several micro-batches (padded, then
packed) and checks values, metrics, gradients and weights of both steps against the reference.
`[NAME:]LAYOUT@POLICY_LAYOUT` runs the same value engine on process groups of its own
(`parallel.LayoutGroups`) beside a policy on POLICY_LAYOUT, the layout `parallel.initialize`
made: the policy runs between the critic's steps, and its log-probs must not change.

Prints one JSON line per check on rank 0: {"layout", "check", "value", "tol", "ok"}. Several
`--layout`s run one after another in the same processes (start-up is most of their time).
"""

from __future__ import annotations

import argparse
import contextlib
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
from layout_worker import max_abs_diff, restore, trained_weights, weight_differences

from gspo_megatron.algorithms.gae import explained_variance, explained_variance_from_sums
from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.model import ValueHead
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import load_preset
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

VOCAB = 48
MODELS = ("tiny_moe", "tiny_dense")  # dense: tensor parallelism without sequence parallelism
NUM_LAYERS = 2
LR = 0.005  # small enough that the second step starts from a model close to the first's
CLIP = 0.2  # against old values 0.3 * N(0, 1) away: some tokens are clipped, some are not
HEAD_SEED = 2024
HEAD_STD = 0.125  # hidden states after the final norm have RMS ~1: values ~ N(0, 64 * std^2)
STEPS = 2
# Every metric train_value_step reports from the value loss (algorithms/gae.py).
VALUE_METRICS = (
    "loss",
    "value_loss",
    "value_clip_fraction",
    "values",
    "returns",
    "ev_returns_sq",
    "ev_residual",
    "ev_residual_sq",
)


def build_engine(
    model: str,
    layout: ParallelLayout,
    microbatch_tokens: int,
    *,
    value_head: bool = True,
    groups: parallel.LayoutGroups | None = None,
) -> TrainingEngine:
    return TrainingEngine(
        load_preset(model, num_hidden_layers=NUM_LAYERS),
        layout,
        EngineSettings(
            max_sequence_length=64,
            max_tokens_per_microbatch=microbatch_tokens,
            pack_sequences=False,
        ),
        OptimizerSettings(
            name="sgd", lr=LR, clip_grad=0.0, weight_decay=0.0, distributed_optimizer=False
        ),
        value_head=value_head,
        groups=groups,
    )


def seeded_head(hidden_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(HEAD_SEED)
    return HEAD_STD * torch.randn(1, hidden_size, generator=gen)


def value_heads(engine: TrainingEngine) -> list[ValueHead]:
    """This rank's value heads (on the last pipeline stage only)."""
    heads = [getattr(chunk, "output_layer", None) for chunk in engine.unwrapped_chunks]
    return [h for h in heads if isinstance(h, ValueHead)]


def make_samples(seed: int = 7, count: int = 8) -> list[TrainSample]:
    """Random prompts and responses; every third sample's loss mask has a hole (the observation
    between two turns of a multi-turn trajectory)."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        response = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 13))]
        mask = None
        if i % 3 == 1 and len(response) >= 4:
            n = len(response)
            mask = [0.0 if n // 3 <= t < n // 3 + max(1, n // 4) else 1.0 for t in range(n)]
        samples.append(TrainSample(prompt, response, loss_mask=mask))
    return samples


def with_targets(samples, values, seed: int = 11) -> list[TrainSample]:
    """old_values: the given values plus noise (so the clip bites on some tokens); returns:
    N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s, v in zip(samples, values, strict=True):
        n = len(s.response_ids)
        noise = 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
        old = torch.as_tensor(v, dtype=torch.float64) + noise
        returns = torch.randn(n, generator=gen, dtype=torch.float64)
        out.append(
            TrainSample(
                s.prompt_ids,
                s.response_ids,
                loss_mask=s.loss_mask,
                old_values=old.tolist(),
                returns=returns.tolist(),
            )
        )
    return out


def flag(check: str, passed: bool) -> tuple[str, float, float]:
    """A yes/no check as a result: value 1 when it failed."""
    return check, float(not passed), 0.0


def step_metrics(metrics: dict[str, float]) -> dict[str, float]:
    out = {key: metrics[key] for key in VALUE_METRICS}
    out["explained_variance"] = explained_variance_from_sums(metrics)
    return out


# -- the one-process reference and its own checks ----------------------------------------------


class _HiddenStates(torch.nn.Module):
    """In place of the output layer: GPTModel then returns the final-norm hidden states."""

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden, None


@contextlib.contextmanager
def head_removed(chunk):
    head = chunk.output_layer
    chunk.output_layer = _HiddenStates()
    try:
        yield head
    finally:
        chunk.output_layer = head


def reference_values(chunk, samples) -> list[torch.Tensor]:
    """float64 values, differentiable in the chunk's parameters: each sample alone through
    megatron's chunk (no padding, no packing), its response-aligned hidden states (the state
    before each response token) dotted with the head weight."""
    out = []
    with head_removed(chunk) as head:
        for s in samples:
            tokens = torch.tensor([s.prompt_ids + s.response_ids])
            positions = torch.arange(s.length)[None]
            hidden = chunk(tokens, positions, None)[0]  # [L, H]
            start = len(s.prompt_ids) - 1
            h = hidden[start : start + len(s.response_ids)].double()
            out.append(h @ head.weight.double()[0])
    return out


def reference_loss(values, samples) -> tuple[torch.Tensor, float]:
    """PPO's clipped value loss averaged over the masked tokens (float64), and the fraction of
    masked tokens where the clipped term is the larger."""
    total = torch.zeros((), dtype=torch.float64)
    clipped = count = 0
    for v, s in zip(values, samples, strict=True):
        old = torch.tensor(s.old_values, dtype=torch.float64)
        ret = torch.tensor(s.returns, dtype=torch.float64)
        mask = torch.ones(len(v)) if s.loss_mask is None else torch.tensor(s.loss_mask)
        on = mask != 0
        plain = (v - ret) ** 2
        v_clip = old + torch.clamp(v - old, -CLIP, CLIP)
        capped = (v_clip - ret) ** 2
        total = total + 0.5 * torch.maximum(plain, capped)[on].sum()
        clipped += int((capped > plain)[on].sum())
        count += int(on.sum())
    return total / count, clipped / count


def masked_flat(per_sample, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, N] of every response token, and the mask: the batch as explained_variance takes it."""
    flat = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in per_sample])
    mask = torch.cat(
        [
            torch.ones(len(s.response_ids)) if s.loss_mask is None else torch.tensor(s.loss_mask)
            for s in samples
        ]
    )
    return flat[None], mask[None]


def check_refusals(model: str, engine: TrainingEngine, train, results: list) -> None:
    """train_value_step only on a trainable value engine, train_step only on a policy."""
    frozen = TrainingEngine.frozen_copy(engine)
    frozen_values = frozen.forward(train).values
    diff = max_abs_diff(frozen_values, engine.forward(train).values)
    results.append(("frozen_copy_values_max_abs_diff", diff, 0.0))
    policy = build_engine(model, engine.layout, 10_000, value_head=False)
    # Complete inputs for either step: only the kind of engine is wrong.
    with_old_logprobs = [replace(s, old_logprobs=[0.0] * len(s.response_ids)) for s in train]
    attempts = {
        "frozen_value_engine_refuses_train_value_step": (
            lambda: frozen.train_value_step(with_old_logprobs, clip=CLIP),
            RuntimeError,
        ),
        "policy_engine_refuses_train_value_step": (
            lambda: policy.train_value_step(with_old_logprobs, clip=CLIP),
            RuntimeError,
        ),
        "value_engine_refuses_train_step": (
            lambda: engine.train_step(with_old_logprobs, LossSettings("grpo")),
            RuntimeError,
        ),
        "value_step_without_returns_refused": (
            lambda: engine.train_value_step(make_samples(), clip=CLIP),
            ValueError,
        ),
    }
    before = trained_weights(engine)
    for name, (attempt, error) in attempts.items():
        try:
            attempt()
            refused = False
        except error:
            refused = True
        results.append(flag(name, refused))
    after = trained_weights(engine)
    untouched = all(torch.equal(a[k], b[k]) for a, b in zip(before, after, strict=True) for k in a)
    results.append(flag("refused_steps_leave_weights_untouched", untouched))
    for e in (frozen, policy):
        e.close()


def parameters(engine: TrainingEngine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for chunk in engine.unwrapped_chunks for n, p in chunk.named_parameters()]


def save_gradients(engine: TrainingEngine, path: Path) -> None:
    """The last step's gradients (each parameter's `main_grad`, reduced over data-parallel ranks
    as the optimizer applied it) saved as a weights checkpoint in the parameters' place."""
    params = [p for _, p in parameters(engine)]
    weights = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
        checkpointing.save_engine(engine, path, with_optimizer=False)
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)


def make_reference(out: Path, model: str) -> list[tuple[str, float, float | None]]:
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=1234)
    engine = build_engine(model, layout, microbatch_tokens=10_000)
    samples = make_samples()
    results = []
    zero = max(float(abs(v).max()) for v in engine.forward(samples).values)
    results.append(("zero_initialised_head_values_max_abs", zero, 0.0))
    (head,) = value_heads(engine)
    with torch.no_grad():
        head.weight.copy_(seeded_head(head.weight.shape[1]))
    engine.optimizer.reload_model_params()
    checkpointing.save_engine(engine, out / "init", with_optimizer=False)

    (chunk,) = engine.unwrapped_chunks
    values = engine.forward(samples).values
    with torch.no_grad():
        expected = reference_values(chunk, samples)
    results.append(("values_vs_hidden_dot_head_max_abs_diff", max_abs_diff(values, expected), 1e-5))
    train = with_targets(samples, values)
    reference = {"values": [torch.as_tensor(v) for v in values], "steps": []}
    for step in range(1, STEPS + 1):
        name = f"step{step}"
        # Reference gradient: autograd through the loss written out above, every parameter.
        named = parameters(engine)
        ref_values = reference_values(chunk, train)
        loss64, clip_fraction = reference_loss(ref_values, train)
        grads = torch.autograd.grad(loss64, [p for _, p in named], allow_unused=True)
        metrics = engine.train_value_step(train, clip=CLIP)
        worst = largest = trunk_largest = 0.0
        for (key, param), grad in zip(named, grads, strict=True):
            want = torch.zeros_like(param) if grad is None else grad.float()
            largest = max(largest, float(want.abs().max()))
            if "output_layer" not in key:
                trunk_largest = max(trunk_largest, float(want.abs().max()))
            worst = max(worst, float((param.main_grad - want).abs().max()))
        results.append((f"{name}/grad_vs_autograd_max_abs_diff_rel", worst / largest, 1e-5))
        results.append((f"{name}/trunk_grad_max_abs", trunk_largest, None))
        loss_diff = abs(metrics["loss"] - float(loss64))
        results.append((f"{name}/loss_vs_reference_abs_diff", loss_diff, 1e-6))
        results.append((f"{name}/loss", metrics["loss"], None))
        results.append((f"{name}/clip_fraction", metrics["value_clip_fraction"], None))
        clip_diff = abs(metrics["value_clip_fraction"] - clip_fraction)
        results.append((f"{name}/clip_fraction_vs_reference_abs_diff", clip_diff, 1e-12))
        v_flat, mask = masked_flat([v.detach() for v in ref_values], train)
        r_flat, _ = masked_flat([s.returns for s in train], train)
        ev_diff = abs(
            explained_variance_from_sums(metrics) - explained_variance(v_flat, r_flat, mask)
        )
        results.append((f"{name}/explained_variance_vs_reference_abs_diff", ev_diff, 1e-6))
        save_gradients(engine, out / f"grad_step{step}")
        checkpointing.save_engine(engine, out / f"after_step{step}", with_optimizer=False)
        after = engine.forward(train).values
        reference["steps"].append(
            {"metrics": step_metrics(metrics), "values": [torch.as_tensor(v) for v in after]}
        )
    # The second step starts where the first left off: the loss went down.
    first, second = (s["metrics"]["loss"] for s in reference["steps"])
    results.append(flag("sgd_step_lowers_the_loss", second < first))
    check_refusals(model, engine, train, results)
    torch.save(reference, out / "reference.pt")
    engine.close()
    return results


# -- layouts -------------------------------------------------------------------------------------


def loaded_head_difference(engine: TrainingEngine) -> float:
    """Largest difference (over ranks) of the loaded heads from the seeded one."""
    worst = torch.zeros(1)
    for head in value_heads(engine):
        diff = (head.weight.detach() - seeded_head(head.weight.shape[1])).abs().max()
        worst = torch.maximum(worst, diff.reshape(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def gradient_differences(engine: TrainingEngine, expected) -> tuple[float, float]:
    """Largest difference of each parameter's gradient (`main_grad`) from the reference's,
    relative to the reference gradient's largest entry in that tensor, and the number of
    parameters the reference lacks (max and sum over ranks)."""
    worst = torch.zeros(1)
    missing = torch.zeros(1)
    for chunk, ref_sd in zip(engine.unwrapped_chunks, expected, strict=True):
        for key, param in chunk.named_parameters():
            if key not in ref_sd:
                missing += 1
                continue
            want = ref_sd[key]
            diff = (param.main_grad - want).abs().max() / want.abs().max().clamp_min(1e-12)
            worst = torch.maximum(worst, diff.reshape(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(missing)
    return float(worst), float(missing)


def check_layout(
    ref_root: Path,
    model: str,
    layout: ParallelLayout,
    tokens: int,
    policy_layout: ParallelLayout | None = None,
) -> list[tuple[str, float, float | None]]:
    """(check, value, tolerance or None) of every check (rank 0's are reported)."""
    ref_dir = ref_root / model
    samples = make_samples()
    results = []
    policy, groups = None, None
    if policy_layout is None:
        parallel.initialize(layout, seed=1234)
    else:
        parallel.initialize(policy_layout, seed=1234)
        policy = build_engine(model, policy_layout, tokens, value_head=False)
        policy_logprobs = policy.forward(samples).logprobs
        groups = parallel.LayoutGroups(layout, seed=1234)

    def policy_still_runs(when: str) -> None:
        if policy is not None:
            diff = max_abs_diff(policy.forward(samples).logprobs, policy_logprobs)
            results.append((f"policy_logprobs_unchanged_{when}", diff, 0.0))

    engine = build_engine(model, layout, microbatch_tokens=tokens, groups=groups)
    policy_still_runs("after_building_the_critic")
    reference = torch.load(ref_dir / "reference.pt", weights_only=False)
    checkpointing.load_engine(engine, ref_dir / "init", with_optimizer=False)
    results.append(("loaded_head_vs_seeded_max_abs_diff", loaded_head_difference(engine), 0.0))
    heads = torch.tensor([len(value_heads(engine))])
    dist.all_reduce(heads)  # one on each rank of the last pipeline stage
    results.append(
        flag("one_head_per_last_stage_rank", int(heads) == layout.world_size // layout.pp)
    )
    initial = trained_weights(engine)
    chunks = engine.unwrapped_chunks
    with engine.own_layout():  # sharded reads of the value engine's layout
        weights_after = [
            checkpointing.load_reference_weights(chunks, ref_dir / f"after_step{k}")
            for k in range(1, STEPS + 1)
        ]
        gradients = [
            checkpointing.load_reference_weights(chunks, ref_dir / f"grad_step{k}")
            for k in range(1, STEPS + 1)
        ]
    train = with_targets(samples, [v.numpy() for v in reference["values"]])
    for mode in ("padded", "packed"):
        engine.settings.pack_sequences = mode == "packed"
        restore(engine, initial)
        values = engine.forward(samples).values
        diff = max_abs_diff(values, reference["values"])
        results.append((f"{mode}/values_max_abs_diff", diff, 1e-5))
        if mode == "padded":  # a frozen copy (reward model, reference critic) gives the same
            frozen = TrainingEngine.frozen_copy(engine)
            diff = max_abs_diff(frozen.forward(samples).values, values)
            results.append(("frozen_copy_values_max_abs_diff", diff, 0.0))
            frozen.close()
        start = initial
        for step, ref in enumerate(reference["steps"], 1):
            name = f"{mode}/step{step}"
            metrics = engine.train_value_step(train, clip=CLIP)
            for key, value in step_metrics(metrics).items():
                results.append((f"{name}/{key}_abs_diff", abs(value - ref["metrics"][key]), 1e-6))
            grad_diff, missing = gradient_differences(engine, gradients[step - 1])
            results.append((f"{name}/grad_rel_diff", grad_diff, 1e-5))
            results.append((f"{name}/params_without_reference_grad", missing, 0.0))
            worst = weight_differences(engine, weights_after[step - 1], start)
            results.append((f"{name}/params_rel_diff", float(worst[0]), 1e-6))
            after = engine.forward(train).values
            diff = max_abs_diff(after, ref["values"])
            results.append((f"{name}/values_after_max_abs_diff", diff, 1e-5))
            count = torch.tensor([metrics["num_microbatches"]])
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            results.append((f"{name}/min_microbatches_per_rank", float(count), None))
            start = weights_after[step - 1]
            policy_still_runs(f"after_{mode}_{name.rpartition('/')[2]}")
    engine.close()
    if policy is not None:
        policy.close()
    parallel.destroy_model_parallel()
    return results


def report(layout: str, results) -> None:
    """A result is (check, value, tolerance): ok when value <= tolerance (or no tolerance)."""
    if dist.get_rank() != 0:
        return
    for check, value, tol in results:
        passed = tol is None or value <= tol
        line = {"layout": layout, "check": check, "value": value, "tol": tol, "ok": passed}
        print(json.dumps(line), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--make-reference", type=Path, help="write the reference under DIR/MODEL")
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--ref-dir", type=Path)
    parser.add_argument(
        "--layout", action="append", help="[MODEL:]LAYOUT, e.g. tiny_dense:tp=2 (repeatable)"
    )
    parser.add_argument("--microbatch-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.make_reference:
        out = args.make_reference / args.model
        out.mkdir(parents=True)
        report(f"{args.model}:single", make_reference(out, args.model))
    else:
        world = parallel.world_size_from_env()
        for case in args.layout or [""]:
            critic, _, policy = case.partition("@")
            model, _, text = critic.rpartition(":")
            layout = parse_layout(text, world)
            policy_layout = parse_layout(policy, world) if "@" in case else None
            results = check_layout(
                args.ref_dir, model or MODELS[0], layout, args.microbatch_tokens, policy_layout
            )
            report(case, results)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
