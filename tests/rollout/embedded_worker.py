"""Run alone or under torchrun: the embedded rollout engine against no-cache references.

    python tests/rollout/embedded_worker.py --checks all
    torchrun --nproc-per-node=2 tests/rollout/embedded_worker.py --layout tp=2,sp=1

Every check prints one JSON line on rank 0: {"check", "value", "tol", "ok"} (value: the
measured quantity); `digest` lines carry generated tokens for comparisons across launches.
References: a step-by-step argmax loop that runs `GPTModel.forward` over the whole sequence
without a cache, and `TrainingEngine.forward`'s recomputed log-probs and routes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import types
import warnings

import numpy as np
import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from layout_text import parse_layout

from gspo_megatron.envs.base import Environment, StepResult
from gspo_megatron.megatron import parallel
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.rollout.base import InProcessRolloutEngine, SamplingParams
from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.spec.model_config import load_preset
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

LOGPROB_TOL = 1e-5
MAX_LEN = 40
RANK = 0
LAYOUT = ""  # the layout being checked, named in every line printed


def report(check: str, value, tol=None, ok=None) -> bool:
    if ok is None:
        ok = bool(value <= tol)
    if RANK == 0:
        line = {"layout": LAYOUT, "check": check, "value": value, "tol": tol, "ok": bool(ok)}
        print(json.dumps(line), flush=True)
    return ok


def digest(name: str, groups) -> None:
    """Check that every rank returned the same samples; print a digest of the tokens."""
    content = [[(s.response_ids, s.logprobs, s.finish_reason) for s in g] for g in groups]
    full = hashlib.sha256(json.dumps(content).encode()).hexdigest()
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, full)
    report(f"{name}_identical_on_all_ranks", len(set(values)) - 1, ok=len(set(values)) == 1)
    tokens = [[s.response_ids for s in g] for g in groups]
    value = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    if RANK == 0:
        print(json.dumps({"layout": LAYOUT, "digest": name, "value": value}), flush=True)


def make_prompts(count: int, seed: int, vocab: int, lo: int = 2, hi: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def flat(groups):
    return [s for g in groups for s in g]


# -- references ---------------------------------------------------------------------------------


def full_logits(trainer: TrainingEngine, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), vocab_size]: logits of a plain forward (no cache), gathered over TP."""
    model = trainer.unwrapped_chunks[0]
    tp = trainer.layout.tp
    # sequence parallelism needs a multiple of tp; right padding leaves causal outputs alone
    padded = list(ids) + [0] * (-len(ids) % tp)
    tokens = torch.tensor([padded])
    positions = torch.arange(len(padded))[None]
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, None)[0, : len(ids)]  # [s, V_local] (vocab-parallel)
    model.train()
    if tp > 1:
        from megatron.core import parallel_state

        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(
            parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
        )
        logits = torch.cat(parts, dim=-1)
    return logits[:, : trainer.model_config.vocab_size].float()


def nocache_greedy(trainer: TrainingEngine, prompt: list[int], new_tokens: int):
    """Argmax loop over the whole sequence, one full forward per token."""
    ids = list(prompt)
    logprobs = []
    for _ in range(new_tokens):
        logits = full_logits(trainer, ids)[-1]
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], logprobs


def recomputed_logprobs(trainer: TrainingEngine, samples, record_routes: bool = False):
    train = [TrainSample(s.prompt_ids, s.response_ids) for s in samples]
    return trainer.forward(train, record_routes=record_routes)


def max_logprob_diff(samples, reference) -> float:
    return max(
        float(np.abs(np.asarray(s.logprobs) - np.asarray(ref)).max())
        for s, ref in zip(samples, reference, strict=True)
    )


# -- checks ------------------------------------------------------------------------------------


def check_greedy(trainer, engine, tag: str) -> None:
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(5, seed=1, vocab=vocab)
    out = engine.generate(prompts, 2, SamplingParams(temperature=0, max_new_tokens=10, seed=0))
    same = True
    diff = 0.0
    for prompt, group in zip(prompts, out, strict=True):
        ref_tokens, ref_lp = nocache_greedy(trainer, prompt, 10)
        for sample in group:
            same &= sample.response_ids == ref_tokens and sample.finish_reason == "length"
            diff = max(diff, float(np.abs(np.asarray(sample.logprobs) - ref_lp).max()))
    report(f"{tag}greedy_equals_nocache_argmax", int(not same), ok=same)
    report(f"{tag}greedy_logprob_vs_nocache", diff, LOGPROB_TOL)
    digest(f"{tag}greedy", out)


def check_sampled_logprobs(trainer, engine, tag: str) -> None:
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(6, seed=2, vocab=vocab)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    out = engine.generate(prompts, 3, params)
    samples = flat(out)
    ref = recomputed_logprobs(trainer, samples)
    report(f"{tag}sampled_logprob_vs_trainer", max_logprob_diff(samples, ref.logprobs), 1e-5)
    digest(f"{tag}sampled", out)


def check_processed_logprobs(trainer, engine, tag: str) -> None:
    """temperature/top-k/top-p: log-probs of the renormalised processed distribution."""
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(3, seed=3, vocab=vocab)
    params = SamplingParams(temperature=0.7, top_k=12, top_p=0.8, max_new_tokens=8, seed=9)
    out = engine.generate(prompts, 2, params)
    diff = 0.0
    outside = 0
    for sample in flat(out):
        logits = full_logits(trainer, sample.prompt_ids + sample.response_ids)
        start = len(sample.prompt_ids) - 1
        for j, token in enumerate(sample.response_ids):
            processed = torch.log_softmax(_processed(logits[start + j], params), -1)
            if math.isinf(float(processed[token])):
                outside += 1
                continue
            diff = max(diff, abs(float(processed[token]) - sample.logprobs[j]))
    report(f"{tag}processed_tokens_outside_topk_topp", outside, ok=outside == 0)
    report(f"{tag}processed_logprob_vs_reference", diff, LOGPROB_TOL)


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference processing written independently: temperature, then top-k and top-p masks."""
    x = logits / params.temperature
    order = torch.argsort(x, descending=True)
    probs = torch.softmax(x, -1)[order]
    keep = torch.zeros_like(x, dtype=torch.bool)
    mass = 0.0
    for rank, index in enumerate(order.tolist()):
        if params.top_k > 0 and rank >= params.top_k:
            break
        if mass >= params.top_p:
            break
        keep[index] = True
        mass += float(probs[rank])
    return x.masked_fill(~keep, -math.inf)


def check_stop_and_length(trainer, engine, tag: str) -> None:
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(8, seed=4, vocab=vocab)
    free = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12, seed=11))
    # stop on tokens the unconstrained run produced mid-way, so some responses stop early
    stops = tuple({s.response_ids[3] for s in flat(free)[:4]})
    params = SamplingParams(max_new_tokens=12, stop_token_ids=stops, seed=11)
    out = engine.generate(prompts, 2, params)
    ok = True
    stopped = 0
    for sample, unconstrained in zip(flat(out), flat(free), strict=True):
        ids = sample.response_ids
        first_stop = next((i for i, t in enumerate(unconstrained.response_ids) if t in stops), None)
        if first_stop is None:
            ok &= sample.finish_reason == "length" and ids == unconstrained.response_ids
        else:
            stopped += 1
            ok &= (
                sample.finish_reason == "stop"
                and ids == unconstrained.response_ids[: first_stop + 1]
            )
        ok &= len(ids) == len(sample.logprobs) and len(ids) <= 12
        ok &= all(t not in stops for t in ids[:-1])
    report(f"{tag}stop_tokens_and_max_new_tokens", int(not ok), ok=ok and stopped > 0)
    # prompt + response never exceeds the trainer's maximum sequence length
    long_prompt = make_prompts(2, seed=5, vocab=vocab, lo=MAX_LEN - 3, hi=MAX_LEN - 3)
    capped = engine.generate(long_prompt, 1, SamplingParams(max_new_tokens=10, seed=1))
    lengths = [len(s.response_ids) for s in flat(capped)]
    ok = lengths == [3, 3] and all(s.finish_reason == "length" for s in flat(capped))
    report(f"{tag}max_sequence_length_cap", int(not ok), ok=ok)


def check_determinism(trainer, engine, tag: str, backend: str) -> None:
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(6, seed=6, vocab=vocab)
    params = SamplingParams(max_new_tokens=10, seed=21, top_p=0.95)
    a = engine.generate(prompts, 4, params)
    b = engine.generate(prompts, 4, params)
    small = EmbeddedEngine(trainer, max_batch_tokens=60, backend=backend)
    c = small.generate(prompts, 4, params)
    d = engine.generate(prompts, 4, SamplingParams(max_new_tokens=10, seed=22, top_p=0.95))
    tokens = lambda groups: [s.response_ids for s in flat(groups)]  # noqa: E731
    report(f"{tag}same_seed_same_samples", int(tokens(a) != tokens(b)), ok=tokens(a) == tokens(b))
    report(f"{tag}independent_of_batching", int(tokens(a) != tokens(c)), ok=tokens(a) == tokens(c))
    report(f"{tag}other_seed_other_samples", int(tokens(a) == tokens(d)), ok=tokens(a) != tokens(d))
    # seed=None: successive calls differ, a fresh engine replays the same sequence of calls
    unseeded = SamplingParams(max_new_tokens=10)
    first = EmbeddedEngine(trainer, seed=3, backend=backend)
    second = EmbeddedEngine(trainer, seed=3, backend=backend)
    x1, x2 = first.generate(prompts, 2, unseeded), first.generate(prompts, 2, unseeded)
    y1, y2 = second.generate(prompts, 2, unseeded), second.generate(prompts, 2, unseeded)
    ok = tokens(x1) == tokens(y1) and tokens(x2) == tokens(y2) and tokens(x1) != tokens(x2)
    report(f"{tag}unseeded_calls_reproducible", int(not ok), ok=ok)


def check_uneven_shares(trainer, backend: str, tag: str) -> None:
    """Replicas with different amounts of work (lock-step: idle replicas run dummy forwards)."""
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(4, seed=9, vocab=vocab, lo=2, hi=2)
    prompts += make_prompts(4, seed=10, vocab=vocab, lo=20, hi=24)
    engine = EmbeddedEngine(trainer, max_batch_tokens=70, backend=backend)
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=1))
    samples = flat(out)
    ref = recomputed_logprobs(trainer, samples)
    report(
        f"{tag}uneven_shares_logprob_vs_trainer",
        max_logprob_diff(samples, ref.logprobs),
        LOGPROB_TOL,
    )
    counts = torch.tensor([engine.stats["idle_forwards"]])
    dist.all_reduce(counts)
    if engine._lockstep:
        report(f"{tag}lockstep_idle_forwards", int(counts), ok=int(counts) > 0)
    digest(f"{tag}uneven", out)


def check_routes(trainer, engine, tag: str) -> None:
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(4, seed=7, vocab=vocab)
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, seed=3))
    samples = flat(out)
    ref = recomputed_logprobs(trainer, samples, record_routes=True)
    config = trainer.model_config
    ok = True
    for sample, routes in zip(samples, ref.routes, strict=True):
        got = sample.routed_experts
        shape = (
            len(sample.prompt_ids) + len(sample.response_ids) - 1,
            config.num_hidden_layers,
            config.num_experts_per_tok,
        )
        ok &= got is not None and got.shape == shape and got.dtype == np.int32
        ok &= bool((np.sort(got, -1) == np.sort(routes.astype(np.int32), -1)).all())
    report(f"{tag}routed_experts_equal_trainer_routes", int(not ok), ok=ok)


class IdsEnv(Environment):
    """Observations of 1-5 random token ids (seeded by the turn's text) until the third turn."""

    inline_safe = True

    def __init__(self) -> None:
        self.turns = 0

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        rng = random.Random(turn)
        ids = [rng.randrange(4, 48) for _ in range(rng.randint(1, 5))]
        return StepResult(observation=ids, done=self.turns == 3)


def check_episodes(trainer, engine, tag: str) -> None:
    """Multi-turn trajectories: model tokens' log-probs equal the trainer's recompute over the
    whole trajectory, and the last request's routes cover every token (R3)."""
    from gspo_megatron.data.dataset import Prompt
    from gspo_megatron.data.tokenizer import build_char_tokenizer
    from gspo_megatron.envs.registry import EnvConfig
    from gspo_megatron.ranks import ProcessGroupRanks
    from gspo_megatron.rollout.driver import RolloutDriver
    from gspo_megatron.rollout.episodes import EpisodeRunner

    vocab = trainer.model_config.vocab_size
    ranks = ProcessGroupRanks()
    cfg = EnvConfig(name=f"{__name__}:IdsEnv", max_turns=4, max_tokens=30)
    runner = EpisodeRunner(cfg, build_char_tokenizer(), ranks, MAX_LEN)
    prompts = [Prompt(i, ids, "") for i, ids in enumerate(make_prompts(5, seed=9, vocab=vocab))]
    # a quarter of the vocabulary stops a turn, so turns end early and episodes go on
    params = SamplingParams(max_new_tokens=6, stop_token_ids=tuple(range(0, vocab, 4)), seed=2)
    samples = flat(runner.run(RolloutDriver(engine, ranks, None), prompts, 2, params))
    ref = recomputed_logprobs(trainer, samples, record_routes=True)
    diff, observed, ok = 0.0, 0, True
    for sample, lp, routes in zip(samples, ref.logprobs, ref.routes, strict=True):
        mask = np.asarray(sample.loss_mask) == 1
        observed += int((~mask).sum())
        diff = max(diff, float(np.abs(np.asarray(sample.logprobs) - lp)[mask].max()))
        got = sample.routed_experts
        ok &= got is not None and got.shape[0] == sample_length(sample) - 1
        ok &= bool((np.sort(got, -1) == np.sort(routes.astype(np.int32), -1)).all())
    report(f"{tag}episode_logprob_vs_trainer", diff, 1e-6)
    report(f"{tag}episode_routes_cover_trajectory", int(not ok), ok=ok and observed > 0)
    digest(f"{tag}episodes", [samples])
    check_kept_context(trainer, engine, tag, lambda e: runner.run(e, prompts, 2, params), samples)


def check_kept_context(trainer, engine, tag: str, episodes, plain) -> None:
    """The same episodes with context kept between turns (rollout.prefix_cache_tokens): the
    same tokens, log-probs within 1e-5 and routes; the torch decoder reuses K/V (counted), the
    megatron decoder counts every prompt it prefilled whole; a weight update drops it all."""
    from gspo_megatron.ranks import ProcessGroupRanks
    from gspo_megatron.rollout.driver import RolloutDriver

    kept = EmbeddedEngine(
        trainer, record_routes=True, backend=engine.decoder.name, prefix_cache_tokens=4096
    )
    driver = RolloutDriver(kept, ProcessGroupRanks(), None)
    samples = flat(episodes(driver))
    same, diff = True, 0.0
    for a, b in zip(samples, plain, strict=True):
        same &= a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
        same &= bool((a.routed_experts == b.routed_experts).all())
        diff = max(diff, float(np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs)).max()))
    report(f"{tag}kept_context_same_tokens_and_routes", int(not same), ok=same)
    report(f"{tag}kept_context_logprob_vs_plain", diff, LOGPROB_TOL)
    metrics = driver.fault_metrics()
    reused = metrics["rollout/prefix_cache_reused_tokens"]
    if kept.decoder.keeps_context:
        counted = metrics["rollout/prefix_cache_hits"] > 0 and reused > 0
    else:
        counted = metrics["rollout/prefix_cache_unsupported"] > 0 and reused == 0
    held = len(kept.prefix_cache)
    kept.update_weights(None, 0)
    counted &= len(kept.prefix_cache) == 0 and kept.prefix_cache.held_tokens == 0
    report(f"{tag}kept_context_counted_and_dropped_by_update", int(not counted), ok=counted)
    report(f"{tag}kept_context_held", held, ok=(held > 0) == kept.decoder.keeps_context)


def sample_length(sample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


def check_weight_update(trainer, engine, tag: str) -> None:
    """After a train step + update_weights, samples come from the new weights."""
    vocab = trainer.model_config.vocab_size
    prompts = make_prompts(4, seed=8, vocab=vocab)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, seed=0)
    before = engine.generate(prompts, 1, greedy)
    samples = flat(engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, seed=4)))
    train = []
    for i, s in enumerate(samples):
        train.append(
            TrainSample(
                s.prompt_ids,
                s.response_ids,
                advantage=1.0 if i % 2 else -1.0,
                old_logprobs=list(s.logprobs),
            )
        )
    trainer.train_step(train, LossSettings("grpo"))
    engine.update_weights(None, 7)
    after = engine.generate(prompts, 1, greedy)
    moved = max(
        float(np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs)).max())
        for a, b in zip(flat(before), flat(after), strict=True)
    )
    report(f"{tag}update_changes_logprobs", moved, ok=moved > 1e-3)
    same = True
    diff = 0.0
    for prompt, (sample,) in zip(prompts, after, strict=True):
        ref_tokens, ref_lp = nocache_greedy(trainer, prompt, 8)
        same &= sample.response_ids == ref_tokens and sample.weight_version == 7
        diff = max(diff, float(np.abs(np.asarray(sample.logprobs) - ref_lp).max()))
    report(f"{tag}after_update_equals_new_model_reference", int(not same), ok=same)
    report(f"{tag}after_update_logprob_vs_nocache", diff, LOGPROB_TOL)
    sampled = flat(engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, seed=5)))
    ref = recomputed_logprobs(trainer, sampled)
    report(
        f"{tag}after_update_sampled_logprob_vs_trainer",
        max_logprob_diff(sampled, ref.logprobs),
        LOGPROB_TOL,
    )


def check_modes_restored(trainer, tag: str) -> None:
    modules = trainer.model
    training = all(m.training for m in modules)
    sp_ok = trainer.config.sequence_parallel == trainer.layout.sequence_parallel
    report(f"{tag}train_mode_and_sequence_parallel_restored", 0, ok=training and sp_ok)


def check_interface(trainer, backend: str, tag: str) -> None:
    engine = EmbeddedEngine(trainer, backend=backend)
    ok = isinstance(engine, InProcessRolloutEngine) and engine.generates_on_every_rank
    try:
        engine.update_weights(object(), 1)  # type: ignore[arg-type]
        ok = False
    except ValueError:
        pass
    for bad in ([[]], [[trainer.model_config.vocab_size]], [[1] * MAX_LEN]):
        try:
            engine.generate(bad, 1, SamplingParams(max_new_tokens=2))
            ok = False
        except ValueError:
            pass
    ok &= engine.generate([], 2, SamplingParams(max_new_tokens=2)) == []
    for refused in (ParallelLayout(pp=2, world_size=2), ParallelLayout(cp=2, world_size=2)):
        try:
            EmbeddedEngine(types.SimpleNamespace(layout=refused))
            ok = False
        except ValueError as err:
            ok &= "SGLang" in str(err)
    try:
        EmbeddedEngine(trainer, backend="vllm")
        ok = False
    except ValueError:
        pass
    engine.close()
    try:
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
        ok = False
    except RuntimeError:
        pass
    report(f"{tag}interface", int(not ok), ok=ok)


# -- main ---------------------------------------------------------------------------------------

CHECKS = [
    "interface",
    "greedy",
    "sampled",
    "processed",
    "stop",
    "determinism",
    "uneven",
    "routes",
    "episodes",
    "update",
]


def main() -> int:
    global LAYOUT
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--layout", action="append", help="e.g. tp=2,sp=1 or ep=2 (repeatable: one after another)"
    )
    parser.add_argument("--backends", action="append", help="per --layout (default torch,megatron)")
    parser.add_argument("--checks", default="all")
    args = parser.parse_args()
    checks = CHECKS if args.checks == "all" else args.checks.split(",")
    layouts = args.layout or [""]
    backends = args.backends or ["torch,megatron"] * len(layouts)
    if len(backends) != len(layouts):
        parser.error("give one --backends per --layout")
    for LAYOUT, names in zip(layouts, backends, strict=True):
        check_layout(LAYOUT, names.split(","), checks)
    parallel.destroy()
    return 0


def check_layout(text: str, backends: list[str], checks: list[str]) -> None:
    global RANK
    layout = parse_layout(text, parallel.world_size_from_env())
    parallel.initialize(layout, seed=1234)
    RANK = dist.get_rank()
    config = load_preset("tiny_moe")
    for backend in backends:
        parallel.seed_everything(1234)  # the same initial weights for every backend
        trainer = TrainingEngine(
            config,
            layout,
            EngineSettings(max_sequence_length=MAX_LEN),
            OptimizerSettings(lr=3e-3, weight_decay=0.01),
        )
        try:
            engine = EmbeddedEngine(trainer, record_routes=True, backend=backend)
        except ValueError as err:  # e.g. backend=torch on a split model
            report(
                f"{backend}_unavailable", str(err), ok=backend == "torch" and layout.world_size > 1
            )
            trainer.close()
            continue
        tag = f"{engine.decoder.name}_"
        if "interface" in checks:
            check_interface(trainer, backend, tag)
        if "greedy" in checks:
            check_greedy(trainer, engine, tag)
        if "sampled" in checks:
            check_sampled_logprobs(trainer, engine, tag)
        if "processed" in checks:
            check_processed_logprobs(trainer, engine, tag)
        if "stop" in checks:
            check_stop_and_length(trainer, engine, tag)
        if "determinism" in checks:
            check_determinism(trainer, engine, tag, backend)
        if "uneven" in checks:
            check_uneven_shares(trainer, backend, tag)
        if "routes" in checks:
            check_routes(trainer, engine, tag)
        if "episodes" in checks:
            check_episodes(trainer, engine, tag)
        check_modes_restored(trainer, tag)
        if "update" in checks:
            check_weight_update(trainer, engine, tag)
        trainer.close()
    parallel.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
