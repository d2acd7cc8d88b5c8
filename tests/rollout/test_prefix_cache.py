"""Context kept between generate calls (rollout/embedded/prefix_cache.py) in the torch decoder.

A tiny random Qwen3 (dense and MoE) generates with `GenerationBatch` as the embedded engine
does; the same calls run with and without a prefix cache:

- the second turn of two-turn episodes prefills only its new tokens (the last sampled token of
  turn one and the observation), counted, and samples the same tokens with log-probs within
  1e-5 of the run without the cache (and routes equal, for R3);
- a context is found by token ids alone, only when the prompt starts with it;
- under a small budget the least recently used contexts are evicted (counted), a context longer
  than the budget is not kept, and the prefill falls back to the whole prompt;
- a new weight version drops every context (counted), and the samples are those of the new
  weights;
- a decoder that cannot reuse K/V (megatron's) counts every prompt it prefills whole;
- the generator process (rollout.mode one_step_off / async) keeps each job's K/V for the next
  job (an episode's next turn), samples as without them, and drops them when it takes new
  weights (counted).
"""

from __future__ import annotations

import itertools
import math
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from gspo_megatron.rollout.base import RolloutSample, SamplingParams
from gspo_megatron.rollout.embedded.batching import GenerationBatch, make_sequences, plan_batches
from gspo_megatron.rollout.embedded.generator import (
    GeneratorProcessEngine,
    GeneratorSettings,
    ProcessGenerator,
    _Job,
)
from gspo_megatron.rollout.embedded.prefix_cache import (
    KeptContext,
    PrefixCache,
    prefix_cache_metrics,
)
from gspo_megatron.rollout.embedded.torch_decoder import (
    DecoderSpec,
    TorchDecoder,
    hf_decoder_weights,
)
from gspo_megatron.spec.model_config import ModelConfig

VOCAB = 64


def tiny_config(moe: bool) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe" if moe else "qwen3",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=10_000.0,
        max_position_embeddings=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors of a random tiny model (what the generator process holds)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    h, d = cfg.hidden_size, cfg.head_dim
    out = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, h, scale=1.0),
        "lm_head.weight": rand(cfg.vocab_size, h),
        "model.norm.weight": 1 + rand(h, scale=0.1),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": rand(cfg.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": rand(cfg.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": rand(cfg.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, cfg.num_attention_heads * d),
            p + "self_attn.q_norm.weight": 1 + rand(d, scale=0.1),
            p + "self_attn.k_norm.weight": 1 + rand(d, scale=0.1),
            p + "input_layernorm.weight": 1 + rand(h, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + rand(h, scale=0.1),
        }
        if cfg.is_moe:
            out[p + "mlp.gate.weight"] = rand(cfg.num_experts, h)
            mlps = [f"{p}mlp.experts.{e}." for e in range(cfg.num_experts)]
            width = cfg.moe_intermediate_size
        else:
            mlps, width = [p + "mlp."], cfg.intermediate_size
        for m in mlps:
            out |= {
                m + "gate_proj.weight": rand(width, h),
                m + "up_proj.weight": rand(width, h),
                m + "down_proj.weight": rand(h, width),
            }
    return out


def rope_table(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)


@dataclass
class TinyEngine:
    """The `Generator` a `GenerationBatch` reads, over a tiny model's HF-named weights."""

    decoder: TorchDecoder
    prefix_cache: PrefixCache | None
    record_routes: bool
    route_shape: tuple[int, int]
    device: torch.device = torch.device("cpu")
    weight_version: int = 0
    tracks_versions: bool = False
    max_batch_tokens: int = 4096

    def refresh_weights(self) -> bool:
        return False

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[RolloutSample]:
        """One sample per prompt, as EmbeddedEngine.generate makes them."""
        seqs = make_sequences(prompts, 1, params, vocab_size=VOCAB, max_sequence_length=256)
        results = {}
        with torch.no_grad():
            for chunk in plan_batches(seqs, self.max_batch_tokens):
                batch = GenerationBatch(self, chunk, params, params.seed)
                for _ in batch.run():
                    pass
                results.update(batch.results)
        if self.prefix_cache is not None:
            self.prefix_cache.end_call()
        return [results[k] for k in range(len(prompts))]


def tiny_spec(cfg: ModelConfig) -> DecoderSpec:
    return DecoderSpec(
        heads=cfg.num_attention_heads,
        groups=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        topk=cfg.num_experts_per_tok if cfg.is_moe else 0,
        pre_softmax=False,
        router_dtype=None,
        vocab_size=VOCAB,
        scale=1 / math.sqrt(cfg.head_dim),
    )


def make_engine(
    moe: bool,
    budget: int | None,
    *,
    seed: int = 0,
    routes: bool = False,
    dtype: torch.dtype = torch.float32,
):
    cfg = tiny_config(moe)
    spec = tiny_spec(cfg)
    table = rope_table(cfg)

    def weights(seed: int):
        tensors = {k: v.to(dtype) for k, v in random_weights(cfg, seed).items()}
        return hf_decoder_weights(tensors, cfg, spec, table)

    state = {"weights": weights(seed)}
    decoder = TorchDecoder(spec, lambda: state["weights"], record_routes=routes)
    cache = PrefixCache(budget) if budget else None
    engine = TinyEngine(decoder, cache, routes, (cfg.num_hidden_layers, spec.topk))
    engine.swap = lambda s: state.update(weights=weights(s))
    return engine


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)


def first_prompts(count: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (5 + 3 * i,), generator=gen).tolist() for i in range(count)]


def next_prompts(prompts, samples, observation_lengths) -> list[list[int]]:
    """Turn two's contexts: turn one's prompt and response, then an observation."""
    gen = torch.Generator().manual_seed(11)
    return [
        p + s.response_ids + torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        for p, s, n in zip(prompts, samples, observation_lengths, strict=True)
    ]


def assert_same_samples(a: list[RolloutSample], b: list[RolloutSample], tol: float = 1e-5):
    for x, y in zip(a, b, strict=True):
        assert x.response_ids == y.response_ids
        assert max(map(abs, (u - v for u, v in zip(x.logprobs, y.logprobs, strict=True)))) <= tol
        if x.routed_experts is not None:
            assert (x.routed_experts == y.routed_experts).all()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_second_turn_prefills_only_new_tokens(moe):
    cached = make_engine(moe, budget=4096, routes=moe)
    plain = make_engine(moe, budget=None, routes=moe)
    prompts = first_prompts()
    turn1 = cached.generate(prompts, PARAMS)
    assert_same_samples(turn1, plain.generate(prompts, PARAMS))
    first = cached.prefix_cache.take_counts()
    assert first.hits == 0 and first.kept == len(prompts)
    assert first.prefill_tokens == sum(map(len, prompts))
    # the same observation length: every row's new tokens start at the same slot
    contexts = next_prompts(prompts, turn1, [3] * len(prompts))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=8)
    turn2 = cached.generate(contexts, params)
    counts = cached.prefix_cache.take_counts()
    assert counts.hits == len(prompts)
    # new: the last token turn one sampled (never fed) and the observation
    assert counts.prefill_tokens == len(prompts) * (1 + 3)
    assert counts.reused_tokens == sum(len(c) - 4 for c in contexts)
    assert_same_samples(turn2, plain.generate(contexts, params))
    # the turn-one contexts were extended by turn two's: only those remain
    assert len(cached.prefix_cache) == len(prompts)
    assert cached.prefix_cache.held_tokens == sum(
        len(c) + len(s.response_ids) - 1 for c, s in zip(contexts, turn2, strict=True)
    )


def test_uneven_new_tokens_reuse_up_to_the_first_missing_slot():
    """Rows share one prefill: it starts where the row with the most new tokens needs it, and
    the other rows feed again (their own tokens) what lies after that."""
    cached, plain = make_engine(False, 4096), make_engine(False, None)
    prompts = first_prompts(3)
    turn1 = cached.generate(prompts, PARAMS)
    plain.generate(prompts, PARAMS)
    cached.prefix_cache.take_counts()
    contexts = next_prompts(prompts, turn1, [1, 4, 2])
    turn2 = cached.generate(contexts, PARAMS)
    counts = cached.prefix_cache.take_counts()
    longest = max(map(len, contexts))
    new = 1 + 4  # the row with the most new tokens (all rows' prompts end at the same slot)
    assert counts.hits == 3
    assert counts.prefill_tokens == 3 * new
    assert counts.reused_tokens == sum(len(c) for c in contexts) - 3 * new
    assert longest - new > 0
    assert_same_samples(turn2, plain.generate(contexts, PARAMS))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bitwise_in_float64(moe):
    """The kept K/V come from decode steps, a whole-prompt prefill computes them in one
    matmul: in float32 they differ by rounding (~1e-6 in the log-probs above), in float64 the
    log-probs (of float32 logits) are equal bit for bit, greedy and sampled."""
    cached = make_engine(moe, 4096, routes=moe, dtype=torch.float64)
    plain = make_engine(moe, None, routes=moe, dtype=torch.float64)
    prompts = first_prompts()
    for params in (SamplingParams(temperature=0.0, max_new_tokens=5, seed=0), PARAMS):
        turn1 = cached.generate(prompts, params)
        assert_same_samples(turn1, plain.generate(prompts, params), tol=0.0)
        contexts = next_prompts(prompts, turn1, [2, 3, 2, 1])
        turn2 = cached.generate(contexts, params)
        assert cached.prefix_cache.take_counts().hits == len(prompts)
        assert_same_samples(turn2, plain.generate(contexts, params), tol=0.0)


def test_found_by_token_ids_only():
    cache = PrefixCache(100)

    def context(tokens):
        t = torch.zeros(1, len(tokens), 2)
        return KeptContext(list(tokens), [t], [t], None)

    cache.keep(context([1, 2, 3]), version=0)
    cache.keep(context([1, 2, 3, 4, 5]), version=0)
    assert cache.lookup([1, 2, 3, 4, 5, 6], 0).tokens == [1, 2, 3, 4, 5]  # the longest
    assert cache.lookup([1, 2, 3, 4], 0).tokens == [1, 2, 3]
    assert cache.lookup([1, 2, 3], 0) is None  # a token must be left to feed
    assert cache.lookup([1, 2, 4, 4, 5, 6], 0) is None
    assert cache.lookup([9, 1, 2, 3, 4], 0) is None
    cache.end_call()  # [1, 2, 3] is extended by [1, 2, 3, 4, 5]
    assert len(cache) == 1 and cache.held_tokens == 5
    assert cache.lookup([1, 2, 3, 4, 5, 6], 1) is None  # another weight version
    counts = cache.take_counts()
    assert (counts.hits, counts.lookups, counts.invalidated) == (2, 6, 1)
    with pytest.raises(ValueError, match="rollout.prefix_cache_tokens"):
        PrefixCache(0)


def test_eviction_under_a_small_budget():
    # room for about one turn-one context: the older ones are evicted as new ones arrive
    budget = 20
    cached, plain = make_engine(False, budget), make_engine(False, None)
    prompts = first_prompts(4)  # 5, 8, 11, 14 tokens; + up to 5 response tokens each
    turn1 = cached.generate(prompts, PARAMS)
    counts = cached.prefix_cache.take_counts()
    assert counts.evictions >= 2
    assert cached.prefix_cache.held_tokens <= budget
    held = len(cached.prefix_cache)
    contexts = next_prompts(prompts, turn1, [2] * 4)
    turn2 = cached.generate(contexts, PARAMS)
    counts = cached.prefix_cache.take_counts()
    assert counts.hits == held < len(prompts)
    assert counts.reused_tokens > 0
    assert_same_samples(turn2, plain.generate(contexts, PARAMS))
    # a context longer than the whole budget is not kept
    long_prompt = [list(range(1, 30))]
    cached.generate(long_prompt, PARAMS)
    assert cached.prefix_cache.take_counts().evictions >= 1
    assert cached.prefix_cache.held_tokens <= budget


def test_weight_update_invalidates():
    cached, plain = make_engine(True, 4096, routes=True), make_engine(True, None, routes=True)
    prompts = first_prompts()
    turn1 = cached.generate(prompts, PARAMS)
    plain.generate(prompts, PARAMS)
    cached.prefix_cache.take_counts()
    for engine in (cached, plain):
        engine.swap(1)
        engine.weight_version = 1
    contexts = next_prompts(prompts, turn1, [3] * 4)
    turn2 = cached.generate(contexts, PARAMS)
    counts = cached.prefix_cache.take_counts()
    assert counts.hits == 0 and counts.invalidated == len(prompts)
    assert counts.prefill_tokens == sum(map(len, contexts))
    assert_same_samples(turn2, plain.generate(contexts, PARAMS), tol=0.0)
    metrics = prefix_cache_metrics(counts, cached.prefix_cache.held_tokens)
    assert metrics["rollout/prefix_cache_invalidated"] == len(prompts)
    assert metrics["rollout/prefix_cache_reused_fraction"] == 0.0


def test_decoder_without_kept_context_is_counted():
    engine = make_engine(False, 4096)
    engine.decoder.keeps_context = False  # as MegatronDecoder
    prompts = first_prompts()
    turn1 = engine.generate(prompts, PARAMS)
    engine.generate(next_prompts(prompts, turn1, [2] * 4), PARAMS)
    counts = engine.prefix_cache.take_counts()
    assert counts.unsupported == 2 * len(prompts)
    assert counts.hits == counts.reused_tokens == len(engine.prefix_cache) == 0


def generator_settings(moe: bool, budget: int) -> GeneratorSettings:
    cfg = tiny_config(moe)
    spec = tiny_spec(cfg)
    return GeneratorSettings(
        model=cfg,
        spec=spec,
        max_batch_tokens=4096,
        max_sequence_length=256,
        record_routes=moe,
        route_shape=(cfg.num_hidden_layers, spec.topk),
        partial=False,
        seed=0,
        prefix_cache_tokens=budget,
    )


def test_generator_process_keeps_context_between_jobs():
    """rollout.mode one_step_off / async: the generator process keeps each job's K/V for the
    next (an episode's next turn is a job of its own), samples as without them, and drops them
    when it takes new weights."""
    cfg = tiny_config(True)
    generators = []
    for budget in (4096, 0):
        staging = {k: v.clone() for k, v in random_weights(cfg, 0).items()}
        published = types.SimpleNamespace(value=0)
        generator = ProcessGenerator(
            generator_settings(True, budget), staging, rope_table(cfg), threading.Lock(), published
        )
        generator.take_weights()
        generators.append(generator)
    cached, plain = generators
    jobs = itertools.count()

    def run(generator, prompts, params, version=0):
        job = _Job(next(jobs), prompts, 1, params, min_version=version, urgent=False)
        samples, progress = generator.run(job)
        assert progress is None
        return [g[0] for g in samples]

    prompts = first_prompts()
    turn1 = run(cached, prompts, PARAMS)
    assert_same_samples(turn1, run(plain, prompts, PARAMS))
    counts, held = cached.take_cache_counts()
    assert counts.kept == len(prompts) and counts.hits == 0
    assert plain.take_cache_counts() is None
    contexts = next_prompts(prompts, turn1, [3] * len(prompts))
    turn2 = run(cached, contexts, PARAMS)
    assert_same_samples(turn2, run(plain, contexts, PARAMS))
    counts, held = cached.take_cache_counts()
    assert counts.hits == len(prompts)
    assert counts.prefill_tokens == len(prompts) * (1 + 3)  # turn one's last token, observation
    assert counts.reused_tokens == sum(len(c) - 4 for c in contexts)
    assert held == cached.prefix_cache.held_tokens > 0
    # new weights: everything kept is dropped as they are taken (counted), not reused
    for generator in generators:
        generator.staging.update(random_weights(cfg, 1))
        generator.published.value = 1
        assert generator.take_weights()
    assert len(cached.prefix_cache) == 0 and cached.prefix_cache.held_tokens == 0
    contexts = next_prompts(contexts, turn2, [2] * len(prompts))
    turn3 = run(cached, contexts, PARAMS, version=1)
    assert_same_samples(turn3, run(plain, contexts, PARAMS, version=1), tol=0.0)
    counts, _ = cached.take_cache_counts()
    assert counts.invalidated == len(prompts) and counts.hits == 0
    assert counts.prefill_tokens == sum(map(len, contexts))
    assert {s.weight_version for s in turn3} == {1}


def test_generator_process_reports_kept_context():
    """The process's counts reach the trainer with each job: rollout/prefix_cache_* metrics as
    in rollout.mode=sync, a weight update's dropped contexts included."""
    cfg = tiny_config(False)
    settings = generator_settings(False, 4096)
    tensors = random_weights(cfg, 0)
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    engine = GeneratorProcessEngine(settings, shapes, rope_table(cfg), leader=True)
    try:

        def update(seed: int, version: int) -> None:
            bucket = list(random_weights(cfg, seed).items())
            engine.update_weights(types.SimpleNamespace(buckets=lambda size: [bucket]), version)

        update(0, 0)
        prompts = first_prompts()
        turn1 = [g[0] for g in engine.generate(prompts, 1, PARAMS)]
        contexts = next_prompts(prompts, turn1, [3] * len(prompts))
        engine.generate(contexts, 1, PARAMS)
        metrics = engine.fault_metrics()
        assert metrics["rollout/prefix_cache_hits"] == len(prompts)
        assert metrics["rollout/prefill_tokens"] == sum(map(len, prompts)) + len(prompts) * 4
        assert metrics["rollout/prefix_cache_reused_tokens"] == sum(len(c) - 4 for c in contexts)
        assert metrics["rollout/prefix_cache_held_tokens"] > 0
        update(1, 1)
        engine.generate(contexts, 1, PARAMS)
        metrics = engine.fault_metrics()
        assert metrics["rollout/prefix_cache_invalidated"] == len(prompts)
        assert metrics["rollout/prefix_cache_hits"] == 0
    finally:
        engine.close()
