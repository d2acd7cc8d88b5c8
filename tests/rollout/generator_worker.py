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
    from gspo_megatron.megatron.lora import adapters_off
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.megatron.weight_export import MegatronWeightSource
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.embedded.backend import build_generator_process, generator_settings
    from gspo_megatron.rollout.embedded.batching import GenerationBatch, make_sequences
    from gspo_megatron.rollout.embedded.generator import GeneratorProcessError, ProcessGenerator
    from gspo_megatron.rollout.embedded.in_process import EmbeddedEngine
    from gspo_megatron.spec.layout import ParallelLayout
    from gspo_megatron.spec.lora import LoRASettings
    from gspo_megatron.spec.model_config import load_preset
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

MAX_LEN = 48
TOL = 1e-6  # float32 log-probs: generator process vs the trainer's recompute
# A LoRA policy: the process decodes merged weights (W + s * B @ A), the trainer computes
# W x + s * B (A x); the two orders of float32 rounding differ by ~1e-6 in the log-probs.
LORA_TOL = 1e-5


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
    """A job waits for weights as new as its min_version; an urgent job, and a later one whose
    weights are there, overtake it; a dead process fails what is pending with one clear
    error."""
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
        # submitted after the gated job, not urgent: its weights are there, so it goes first
        ready = engine.start_generate(prompts, 2, params, min_version=0)
        ready.result(timeout=120)
        report("ready_job_overtakes_gated_one", int(gated.done()), ok=not gated.done())
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


def in_process_generator(trainer, mode: str):
    """A ProcessGenerator in this process, over a staging copy of the trainer's weights."""
    source = MegatronWeightSource.from_engine(trainer)
    settings, rope = generator_settings(run_config(mode), trainer, False)
    staging = {}
    for bucket in source.buckets(1 << 30):
        staging.update({name: t.clone() for name, t in bucket})
    published = types.SimpleNamespace(value=0)
    generator = ProcessGenerator(settings, staging, rope, threading.Lock(), published)
    generator.take_weights()
    return generator, settings


def same_samples(a, b) -> bool:
    """Tokens, log-probs, versions and finish reasons equal, bit for bit."""
    key = lambda s: (s.response_ids, s.logprobs, s.versions(), s.finish_reason)  # noqa: E731
    return [key(s) for s in flat(a)] == [key(s) for s in flat(b)]


def check_continuation(trainer) -> None:
    """A response continued from its first tokens (a checkpoint's partial rollout) is the one
    the uninterrupted sequence produces: the same tokens (the same uniforms, from the same
    positions), log-probs within float32 noise of it (the continuation prefills what the
    uninterrupted one decoded token by token), and of the trainer's recompute."""
    generator, settings = in_process_generator(trainer, "async")
    prompts = make_prompts(4, seed=11, vocab=trainer.model_config.vocab_size)
    params = SamplingParams(temperature=1.0, max_new_tokens=14, seed=21)
    seqs = make_sequences(
        prompts, 2, params, vocab_size=settings.spec.vocab_size, max_sequence_length=MAX_LEN
    )
    whole = GenerationBatch(generator, seqs, params, params.seed)
    with torch.no_grad():
        for _ in whole.run():
            pass
    cut = GenerationBatch(generator, seqs, params, params.seed)
    with torch.no_grad():
        for step, _ in enumerate(cut.run()):
            if step == 6:  # the 6th token of every row is decided
                break
    partial = cut.partial()
    lengths = sorted({len(x.response_ids) for x in partial.values()})
    report("partial_rows_hold_their_tokens", lengths, ok=len(partial) == 8 and lengths == [6])
    again = make_sequences(
        prompts, 2, params, vocab_size=settings.spec.vocab_size, max_sequence_length=MAX_LEN,
        prefixes=partial,
    )  # fmt: skip
    rest = GenerationBatch(generator, again, params, params.seed)
    with torch.no_grad():
        for _ in rest.run():
            pass
    a = [whole.results[k] for k in sorted(whole.results)]
    b = [rest.results[k] for k in sorted(rest.results)]
    same = [x.response_ids for x in a] == [x.response_ids for x in b]
    report("continued_tokens_equal_uninterrupted", int(not same), ok=same)
    diff = max(
        abs(u - v)
        for x, y in zip(a, b, strict=True)
        for u, v in zip(x.logprobs, y.logprobs, strict=True)
    )
    report("continued_logprobs_vs_uninterrupted", diff, TOL)
    prefix_kept = all(
        y.logprobs[:6] == partial[k].logprobs for k, y in sorted(rest.results.items())
    )
    report("continued_prefix_logprobs_kept", int(not prefix_kept), ok=prefix_kept)
    sampled = int(rest.sampled) + sum(len(x.response_ids) for x in partial.values())
    total = sum(len(x.response_ids) for x in b)
    report("continued_rows_sample_only_the_rest", sampled - total, ok=sampled == total)
    ref = recomputed_logprobs(trainer, b).logprobs
    report("continued_logprob_vs_trainer", max_logprob_diff(b, ref), TOL)


def check_snapshot_and_resume(trainer) -> None:
    """rollout.mode=async: a snapshot between two tokens records every row's tokens; the job
    goes on from that record, and the same record given to a new job (a resumed run's) gives
    the same samples bit for bit. Nothing recorded is sampled again."""
    engine, source = build_generator_process(run_config("async"), trainer, False)
    try:
        engine.update_weights(source, 0)
        prompts = make_prompts(6, seed=12, vocab=trainer.model_config.vocab_size)
        params = SamplingParams(temperature=1.0, max_new_tokens=MAX_LEN - 10, seed=31)
        job = engine.start_generate(prompts, 4, params)
        # Snapshots one after another (each suspends the job and lets it go on) until one
        # catches rows half-way.
        partial = tokens = 0
        while not partial and not job.done():
            (progress,) = engine.snapshot([job])
            tokens = progress.tokens()
            partial = sum(
                not done and s.response_ids != []
                for g, flags in zip(progress.samples, progress.done, strict=True)
                for s, done in zip(g, flags, strict=True)
            )
        report("snapshot_holds_partial_rows", [tokens, partial], ok=tokens > 0 and partial > 0)
        first = job.result(timeout=300)
        kept = all(
            s.response_ids[: len(r.response_ids)] == r.response_ids
            and s.logprobs[: len(r.logprobs)] == r.logprobs
            for g, h in zip(first, progress.samples, strict=True)
            for s, r in zip(g, h, strict=True)
        )
        report("job_goes_on_from_the_snapshot", int(not kept), ok=kept)
        counted = job.job_stats.sampled_tokens
        total = sum(len(s.response_ids) for s in flat(first))
        report("job_samples_each_token_once", counted - total, ok=counted == total)
        resumed = engine.start_generate(prompts, 4, params, progress=progress)
        second = resumed.result(timeout=300)
        report("resumed_job_equals_the_uninterrupted", 0, ok=same_samples(first, second))
        again = resumed.job_stats.sampled_tokens
        report("resumed_job_samples_only_the_rest", again - (total - tokens),
               ok=again == total - tokens)  # fmt: skip
    finally:
        engine.close()


def check_pinned_jobs(trainer) -> None:
    """one_step_off (pinned): a weight update waits until the jobs pinned to the version before
    have started, so each batch is sampled by the version it was pinned to whatever the
    timing; a snapshot lets the job running finish (the resumed run has no weights for it);
    jobs another thread submits during updates keep their pinned version."""
    engine, source = build_generator_process(run_config("one_step_off"), trainer, False)
    try:
        engine.update_weights(source, 0)
        prompts = make_prompts(6, seed=13, vocab=trainer.model_config.vocab_size)
        params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=41)
        busy = engine.start_generate(prompts, 4, params)
        queued = engine.start_generate(prompts[:2], 2, params)  # pinned to 0 as well
        updated = threading.Event()
        update = threading.Thread(
            target=lambda: (engine.update_weights(source, 1), updated.set()), daemon=True
        )
        update.start()
        time.sleep(0.3)
        report("update_waits_for_the_pinned_job", int(updated.is_set()), ok=not updated.is_set())
        versions = {v for s in flat(queued.result(timeout=300)) for v in s.versions()}
        update.join(timeout=300)
        report("pinned_job_keeps_its_version", sorted(versions), ok=versions == {0})
        running = engine.start_generate(prompts, 4, params)  # pinned to 1
        time.sleep(0.5)
        (progress,) = engine.snapshot([running])
        report("pinned_snapshot_waits_for_the_job", int(not progress.complete),
               ok=progress.complete and running.done())  # fmt: skip
        busy.result(timeout=300)
        # another thread submits jobs one after the other (an episode thread's turns) while
        # updates run: each is sampled by the version it was pinned to, none fails
        stop, jobs = threading.Event(), []

        def submit() -> None:
            while not stop.is_set():
                jobs.append(engine.start_generate(prompts[:1], 1, SamplingParams(max_new_tokens=2)))
                jobs[-1].exception(timeout=300)

        submitter = threading.Thread(target=submit, daemon=True)
        submitter.start()
        for version in range(2, 10):
            engine.update_weights(source, version)
            time.sleep(0.01)
        stop.set()
        submitter.join(timeout=300)
        failed = [j for j in jobs if j.exception() is not None]
        report("pinned_jobs_submitted_during_updates", len(failed),
               ok=not failed and len(jobs) > 1)  # fmt: skip
    finally:
        engine.close()


def perturb_adapters(trainer, scale: float = 0.05) -> None:
    """A new LoRA policy version: what trains moved (the adapters, and the output layer trained
    whole beside them), the base as it is."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in trainer.unwrapped_chunks[0].parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def check_lora_policy(trainer) -> None:
    """A LoRA policy: the process generates with the synced adapters (its log-probs equal the
    trainer's recompute with the adapters, and are far from the base model's); the base goes
    with the first update only, the adapters with each, and so does the output layer, trained
    whole beside them (as lora.modules_to_save trains it)."""
    perturb_adapters(trainer, scale=0.3)  # B = 0 would make the adapters invisible
    trainer.unwrapped_chunks[0].output_layer.weight.requires_grad_(True)
    engine, source = build_generator_process(run_config("one_step_off"), trainer, False)
    base_streams = []
    base_buckets = source.base.buckets
    source.base.buckets = lambda size: (base_streams.append(size), base_buckets(size))[1]
    prompts = make_prompts(5, seed=17, vocab=trainer.model_config.vocab_size)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    try:
        for version in range(2):
            engine.update_weights(source, version)
            samples = flat(engine.generate(prompts, 3, params))
            ref = recomputed_logprobs(trainer, samples).logprobs
            report(f"lora_process_logprob_vs_trainer_v{version}", max_logprob_diff(samples, ref),
                   LORA_TOL)  # fmt: skip
            with adapters_off(trainer.unwrapped_chunks):  # the trained output layer stays
                base = recomputed_logprobs(trainer, samples).logprobs
            gap = max_logprob_diff(samples, base)
            report(f"lora_adapters_change_logprobs_v{version}", gap, ok=gap > 100 * LORA_TOL)
            perturb_adapters(trainer)
        report("lora_base_sent_once", len(base_streams), ok=len(base_streams) == 1)
        trained = sorted(source.trained.hf_shapes()) if source.trained is not None else []
        report("lora_trained_weights_synced", trained, ok=trained == ["lm_head.weight"])
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
    check_continuation(trainer)
    check_snapshot_and_resume(trainer)
    check_pinned_jobs(trainer)
    trainer.close()
    policy = TrainingEngine(
        load_preset("tiny_moe"),
        layout,
        EngineSettings(max_sequence_length=MAX_LEN),
        OptimizerSettings(lr=3e-3),
        lora=LoRASettings(rank=4),
    )
    check_lora_policy(policy)
    policy.close()
    parallel.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
