"""The generator process of rollout.mode one_step_off / async, against the trainer's own model.

    python tests/rollout/generator_worker.py

Prints one JSON line per check ({"check", "value", "tol", "ok"}). References: the in-process
embedded engine (the same seeded samples) and `TrainingEngine.forward`'s recomputed log-probs
with the weights of each token's version.
"""

from __future__ import annotations

import threading
import time
import types
import warnings

# The generator processes this worker starts import it again (as __mp_main__): only a run as a
# script loads megatron-core and builds a trainer.
if __name__ == "__main__":
    import torch
    from embedded_worker import flat, make_prompts, max_logprob_diff, recomputed_logprobs, report

    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported

    from gspo_megatron.config import RunConfig
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.megatron.weight_export import MegatronWeightSource
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.embedded.backend import build_generator_process, generator_settings
    from gspo_megatron.rollout.embedded.batching import GenerationBatch, make_sequences
    from gspo_megatron.rollout.embedded.generator import GeneratorProcessError, ProcessGenerator
    from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

MAX_LEN = 48
TOL = 1e-6  # float32 log-probs: generator process vs the trainer's recompute


def run_config(mode: str) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.mode = mode
    cfg.engine.max_sequence_length = MAX_LEN
    return cfg


def per_version_diff(trainer, samples, snapshots: dict[int, dict]) -> tuple[float, set[int]]:
    """Max |rollout - recompute| over tokens, each recomputed with its own version's weights."""
    current = snapshot(trainer)
    worst, seen = 0.0, set()
    for version, weights in snapshots.items():
        restore(trainer, weights)
        ref = recomputed_logprobs(trainer, samples).logprobs
        for sample, lp in zip(samples, ref, strict=True):
            for j, v in enumerate(sample.versions()):
                if v == version:
                    seen.add(v)
                    worst = max(worst, abs(sample.logprobs[j] - float(lp[j])))
    restore(trainer, current)
    return worst, seen


def snapshot(trainer) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in trainer.unwrapped_chunks[0].named_parameters()}


def restore(trainer, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in trainer.unwrapped_chunks[0].named_parameters():
            p.copy_(weights[k])


def perturb(trainer, scale: float = 0.05) -> None:
    """A new policy version: every weight moved (as an optimizer step would)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in trainer.unwrapped_chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def check_process_equals_embedded(trainer) -> None:
    """The process's samples are the in-process engine's: the same seeded tokens, log-probs that
    equal the trainer's recompute."""
    engine, source = build_generator_process(run_config("one_step_off"), trainer, False)
    try:
        engine.update_weights(source, 0)
        prompts = make_prompts(5, seed=2, vocab=trainer.model_config.vocab_size)
        params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
        out = engine.generate(prompts, 3, params)
        local = EmbeddedEngine(trainer, backend="torch").generate(prompts, 3, params)
        same = [[s.response_ids for s in g] for g in out] == [
            [s.response_ids for s in g] for g in local
        ]
        report("process_tokens_equal_embedded", int(not same), ok=same)
        samples = flat(out)
        ref = recomputed_logprobs(trainer, samples).logprobs
        diff = max_logprob_diff(samples, ref)
        report("process_logprob_vs_trainer", diff, TOL)
        versions = {v for s in samples for v in s.versions()}
        report("process_token_versions", sorted(versions), ok=versions == {0})
    finally:
        engine.close()


def check_partial_rollout(trainer) -> None:
    """New weights published between two tokens: the rows' tokens are fed again under them and
    generation goes on; each token's log-prob is its own version's."""
    source = MegatronWeightSource.from_engine(trainer)
    settings, rope = generator_settings(run_config("async"), trainer, False)
    staging = {}
    for bucket in source.buckets(1 << 30):
        staging.update({name: t.clone() for name, t in bucket})
    published = types.SimpleNamespace(value=0)
    generator = ProcessGenerator(settings, staging, rope, threading.Lock(), published)
    generator.take_weights()
    snapshots = {0: snapshot(trainer)}
    prompts = make_prompts(5, seed=3, vocab=trainer.model_config.vocab_size)
    # A tenth of the vocabulary stops a row: some finish before the swap (here one is still in
    # the batch when it comes: dropped then, not fed again), the others span it.
    vocab = trainer.model_config.vocab_size
    stops = tuple(range(0, vocab, 10))
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=9, stop_token_ids=stops)
    seqs = make_sequences(
        prompts, 2, params, vocab_size=settings.spec.vocab_size, max_sequence_length=MAX_LEN
    )
    batch = GenerationBatch(generator, seqs, params, params.seed)
    with torch.no_grad():
        for step, _ in enumerate(batch.run()):
            if step == 4:  # a few tokens in: version 1 arrives
                perturb(trainer)
                for bucket in source.buckets(1 << 30):
                    for name, tensor in bucket:
                        staging[name].copy_(tensor)
                published.value = 1
                snapshots[1] = snapshot(trainer)
    samples = list(batch.results.values())
    spanning = sum(1 for s in samples if set(s.versions()) == {0, 1})
    report("partial_responses_span_two_versions", spanning, ok=spanning > 0 and batch.swaps == 1)
    before = sum(1 for s in samples if set(s.versions()) == {0} and s.finish_reason == "stop")
    report("rows_finished_before_the_swap", before, ok=before > 0)
    ordered = all(s.versions() == sorted(s.versions()) for s in samples)
    report("partial_versions_in_order", int(not ordered), ok=ordered)
    diff, seen = per_version_diff(trainer, samples, snapshots)
    report("partial_logprob_vs_trainer_per_version", diff, TOL)
    report("partial_both_versions_checked", sorted(seen), ok=seen == {0, 1})
    restore(trainer, snapshots[0])


def check_staleness_gate_and_priority(trainer) -> None:
    """A job waits for weights as new as its min_version; an urgent job overtakes it; a dead
    process fails what is pending with one clear error."""
    engine, source = build_generator_process(run_config("async"), trainer, False)
    try:
        engine.update_weights(source, 0)
        prompts = make_prompts(2, seed=4, vocab=trainer.model_config.vocab_size)
        params = SamplingParams(max_new_tokens=6, seed=1)
        gated = engine.start_generate(prompts, 2, params, min_version=1)
        time.sleep(0.3)  # the process is waiting for version 1 when the urgent job arrives
        urgent = engine.start_generate(prompts, 2, params, min_version=0, urgent=True)
        urgent.result(timeout=120)
        report("urgent_job_overtakes_gated_one", int(gated.done()), ok=not gated.done())
        engine.update_weights(source, 1)
        versions = {v for s in flat(gated.result(timeout=120)) for v in s.versions()}
        waited = gated.job_stats.weights_wait_s
        report("gated_job_waited_for_its_version", waited, ok=versions == {1} and waited > 0)
        doomed = engine.start_generate(prompts, 2, params, min_version=5)
        engine._process.kill()
        try:
            doomed.result(timeout=60)
            report("dead_process_fails_pending_jobs", "no error", ok=False)
        except GeneratorProcessError as err:
            report("dead_process_fails_pending_jobs", str(err), ok="exited" in str(err))
    finally:
        engine.close()


def main() -> int:
    warnings.filterwarnings("ignore")
    layout = ParallelLayout(world_size=1)
    parallel.initialize(layout, seed=1234)
    parallel.seed_everything(1234)
    trainer = TrainingEngine(
        load_preset("tiny_moe"),
        layout,
        EngineSettings(max_sequence_length=MAX_LEN),
        OptimizerSettings(lr=3e-3),
    )
    check_process_equals_embedded(trainer)
    check_partial_rollout(trainer)
    check_staleness_gate_and_priority(trainer)
    trainer.close()
    parallel.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
