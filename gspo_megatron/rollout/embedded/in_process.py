"""The embedded rollout engine: generation in-process from the trainer's own megatron model.

No weight copy: the engine holds the `TrainingEngine` and reads its model chunk's parameters,
so `update_weights(None, version)` only tags later samples with the new version. It is the
default engine of every CPU run and test.

Two decoders run the model with a KV cache (rollout/embedded/decoders.py):
  * "torch" (default when the model is not split: tp = ep = etp = 1): the Qwen3(-MoE) forward as
    plain torch ops over the same parameter tensors. megatron's module overhead costs ~3.5 ms per
    decode step on CPU even for a two-layer model; this path is ~4x faster per step and is
    checked against `GPTModel.forward` when the engine is built (log-probs within 1e-5 in fp32,
    else the engine falls back to megatron's path, or refuses with backend="torch").
  * "megatron": `GPTModel.forward` with megatron's `StaticInferenceContext`; every layout the
    engine accepts (TP with or without sequence parallelism, EP, ETP, DP).

How a generate call runs
  * The `len(prompts) * n` sequences are split into contiguous shares, one per data-parallel
    replica; every tensor-parallel rank of a replica runs the same share, and the results are
    gathered so that every rank returns all samples.
  * A replica sorts its share by prompt length and cuts it into batches of at most
    `max_batch_tokens` KV-cache slots (rows * (longest prompt + longest budget)).
  * Rows share cache slots. The torch decoder left-pads the prompts so all responses start at
    the same slot, with per-row RoPE positions and the padding slots masked out as keys. The
    megatron decoder cannot mask (megatron's static cache gives every row the same positions),
    so prompts start at slot 0 and a row whose prompt is longer than the current slot is fed
    its next prompt token instead of a sample (megatron's own static scheme). Either way each
    real token sees exactly the positions and keys of a no-cache forward.
  * The common prompt prefix is prefilled once per distinct prompt, and its cache rows copied
    to the prompt's n samples. Finished rows are dropped from the batch and the cache once a
    quarter of the rows are finished, so early stops do not cost compute.

Context kept between calls (rollout.prefix_cache_tokens; rollout/embedded/prefix_cache.py)
  * With the torch decoder, the keys and values of every finished sequence (prompt and response
    but its last token) are kept, keyed by their token ids, within a budget of
    `prefix_cache_tokens` tokens (least recently used evicted first). A later prompt that starts
    with a kept sequence (the next turn of a multi-turn episode) reuses them and prefills only
    the tokens after it; in a batch the prefill starts at the first slot any row lacks. Any
    weight update drops everything kept, and so does `release_kept_context` (the trainer's
    rollouts of a step are over: the memory goes back before training).
  * The megatron decoder cannot reuse K/V (see MegatronDecoder): its prompts are prefilled
    whole, counted (rollout/prefix_cache_unsupported), and said once when the engine is built.
  * `metrics` reports the counts since its last call, summed over data-parallel replicas.

Sampling (SGLang's conventions; rollout/embedded/sampling.py) and the reported log-probs
  * temperature 0: greedy (argmax); the log-prob is that of the unprocessed model distribution
    (softmax of the logits), since the point mass actually sampled from would report 0.
  * otherwise: logits / temperature; top-k keeps the k largest; top-p keeps the smallest prefix
    of the descending-sorted softmax(logits / temperature) whose mass reaches top_p (computed on
    the full distribution, as SGLang does, then intersected with top-k). The token is drawn from
    the renormalised kept distribution and its log-prob under that distribution is reported. At
    temperature 1 without top-k/top-p this is log_softmax of the model's logits, the quantity
    `TrainingEngine.forward` recomputes (measured difference ~5e-7 in fp32).
  * The padded vocabulary rows beyond `vocab_size` are never sampled and excluded everywhere.
  * A stop token ends a response (it is kept in `response_ids`, finish_reason "stop"); a response
    that reaches `max_new_tokens`, or the trainer's `max_sequence_length` for prompt+response,
    ends with finish_reason "length".

Determinism: every sequence draws its randomness from its own generator seeded by
(seed, prompt index * n + sample index), one uniform per response position (inverse-CDF
sampling). With the same seed, prompts and n, the samples are therefore the same whatever
`max_batch_tokens`, the batch order, the decoder or the data-parallel size - up to
floating-point differences of the logits between batch shapes, decoders or TP degrees (~1e-7),
which can flip a token only when a uniform falls that close to a CDF boundary. `seed=None`
derives a seed from the engine's `seed` and a per-engine call counter (the same on every rank,
reproducible run to run).

Layouts: tensor parallelism (sequence parallelism is switched off while generating; logits are
gathered over TP so every TP rank samples the same tokens), data parallelism, expert parallelism
(replicas step in lock-step, idle ones with dummy forwards, so the MoE all-to-alls match) and
their combinations. Pipeline and context parallelism are refused: use the SGLang engine there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gspo_megatron.device import accelerator
from gspo_megatron.rollout.base import RolloutSample, SamplingParams, WeightSource
from gspo_megatron.rollout.embedded.batching import GenerationBatch, make_sequences, plan_batches
from gspo_megatron.rollout.embedded.decoders import (
    MegatronDecoder,
    check_against,
    megatron_torch_decoder,
    torch_decoder_unsupported,
)
from gspo_megatron.rollout.embedded.prefix_cache import (
    PrefixCache,
    PrefixCacheCounts,
    prefix_cache_metrics,
)
from gspo_megatron.rollout.embedded.sampling import sequence_seed

if TYPE_CHECKING:
    from gspo_megatron.megatron.training_engine import TrainingEngine

logger = logging.getLogger(__name__)


class EmbeddedEngine:
    """An `InProcessRolloutEngine` that generates with the trainer's own megatron model (KV
    cache, batched).

    Call `generate` on every rank of the trainer with the same arguments; every rank returns the
    same samples. `max_batch_tokens` bounds the KV-cache slots of one batch (rows * (longest
    prompt + longest response)); `record_routes` returns each consumed token's experts
    (`RolloutSample.routed_experts`, for routing replay R3); `seed` seeds calls made with
    `SamplingParams.seed=None`; `backend` picks the decoder: "auto" (the torch decoder when
    the model is not split and passes the check against GPTModel.forward, else megatron's),
    "torch" or "megatron"; `prefix_cache_tokens` bounds the context kept between calls (0:
    none kept; see the module's docstring). `stats` holds this rank's counts for the last call.
    """

    generates_on_every_rank = True
    tracks_versions = False  # the weights change only between generate calls

    def __init__(
        self,
        training_engine: TrainingEngine,
        *,
        max_batch_tokens: int = 65536,
        record_routes: bool = False,
        seed: int = 0,
        backend: str = "auto",
        prefix_cache_tokens: int = 0,
    ) -> None:
        layout = training_engine.layout
        if layout.pp > 1 or layout.cp > 1:
            raise ValueError(
                f"the embedded rollout engine needs parallel.pp=1 and parallel.cp=1 (got "
                f"pp={layout.pp}, cp={layout.cp}); use the SGLang rollout engine (rollout=sglang) "
                "with pipeline or context parallelism"
            )
        if max_batch_tokens < 1:
            raise ValueError(f"rollout.max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if prefix_cache_tokens < 0:
            raise ValueError(
                f"rollout.prefix_cache_tokens must be >= 0 (0: off), got {prefix_cache_tokens}"
            )
        if record_routes and training_engine.routes is None:
            raise ValueError("rollout.record_routes needs a MoE policy (the model has no router)")
        self._trainer = training_engine
        (self.model,) = training_engine.unwrapped_chunks
        self.vocab_size = training_engine.model_config.vocab_size
        self.device = accelerator()
        self.max_sequence_length = min(
            training_engine.settings.max_sequence_length,
            training_engine.model_config.max_position_embeddings,
        )
        self.max_batch_tokens = max_batch_tokens
        self.record_routes = record_routes
        self.seed = seed
        self.weight_version = 0
        config = training_engine.config
        self.route_shape = (config.num_layers, config.moe_router_topk or 0)
        self._dp = layout.dp
        self._dp_group = parallel_state.get_data_parallel_group() if layout.dp > 1 else None
        self._dp_rank = parallel_state.get_data_parallel_rank() if layout.dp > 1 else 0
        # MoE all-to-alls span replicas when experts are split across data-parallel ranks.
        self._lockstep = layout.dp > 1 and (layout.ep > 1 or layout.etp > 1)
        self._calls = 0
        # this rank's share of the last generate call (for logging)
        self.stats: dict[str, int] = {}
        self._closed = False
        self.decoder = self._choose_decoder(backend)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        # the cache's counts since `metrics` was last called, summed over replicas
        self._cache_counts = PrefixCacheCounts()
        self._cache_held = 0
        if self.prefix_cache is not None and not self.decoder.keeps_context:
            logger.warning(
                "rollout.prefix_cache_tokens=%d: the %s decoder cannot reuse kept keys and "
                "values; every prompt is prefilled whole (rollout/prefix_cache_unsupported "
                "counts them)",
                prefix_cache_tokens,
                self.decoder.name,
            )

    # -- InProcessRolloutEngine -------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        """`n` samples for each prompt, grouped per prompt in prompt order (on every rank)."""
        if self._closed:
            raise RuntimeError("generate() on a closed EmbeddedEngine")
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        seed = params.seed
        if seed is None:
            seed = sequence_seed(self.seed, self._calls)
        self._calls += 1
        seqs = make_sequences(
            prompts,
            n,
            params,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
        )
        lo = len(seqs) * self._dp_rank // self._dp
        hi = len(seqs) * (self._dp_rank + 1) // self._dp
        batches = [
            GenerationBatch(self, chunk, params, seed)
            for chunk in plan_batches(seqs[lo:hi], self.max_batch_tokens)
        ]
        self.stats = {
            "sequences": hi - lo,
            "batches": len(batches),
            "forwards": 0,
            "idle_forwards": 0,
        }
        with self._generation_mode():
            if self._lockstep:
                self._run_lockstep(batches)
            else:
                for batch in batches:
                    for _ in batch.run():
                        self.stats["forwards"] += 1
        local = {key: sample for b in batches for key, sample in b.results.items()}
        counts, held = self._call_cache_counts()
        if self._dp > 1:
            parts: list = [None] * self._dp
            dist.all_gather_object(parts, (local, counts, held), group=self._dp_group)
            local = {k: v for part, _, _ in parts for k, v in part.items()}
            counts, held = PrefixCacheCounts(), sum(h for _, _, h in parts)
            for _, part, _ in parts:
                counts.add(part)
        self._cache_counts.add(counts)
        self._cache_held = held
        return [[local[p * n + j] for j in range(n)] for p in range(len(prompts))]

    def update_weights(self, source: WeightSource | None, version: int) -> None:
        """The weights are the trainer's own; only tag later samples with `version`, and drop
        the context kept (whatever the version: weights restored by a rollback may reuse a
        number)."""
        if source is not None:
            raise ValueError(
                "the embedded engine shares the trainer's parameters; call "
                "update_weights(None, version) (no weight source)"
            )
        self.weight_version = version
        if self.prefix_cache is not None:
            self.prefix_cache.invalidate()

    def release_kept_context(self) -> None:
        """The rollouts are over until the weights change: free the context kept."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self._cache_held = 0

    def metrics(self) -> dict[str, float]:
        """rollout/prefix_cache_* counts since the last call, summed over data-parallel
        replicas (the same on every rank); none without a prefix cache."""
        if self.prefix_cache is None:
            return {}
        # (a weight update's invalidations are taken, and summed, with the next call's counts)
        counts, self._cache_counts = self._cache_counts, PrefixCacheCounts()
        return prefix_cache_metrics(counts, self._cache_held)

    def refresh_weights(self) -> bool:
        """The weights are the trainer's, which do not change while it generates."""
        return False

    def close(self) -> None:
        self._closed = True

    # -- internals --------------------------------------------------------------------------

    def _call_cache_counts(self) -> tuple[PrefixCacheCounts, int]:
        """This rank's prefix-cache counts of the call just made, and the tokens it holds."""
        if self.prefix_cache is None:
            return PrefixCacheCounts(), 0
        self.prefix_cache.end_call()
        return self.prefix_cache.take_counts(), self.prefix_cache.held_tokens

    def _run_lockstep(self, batches: list[GenerationBatch]) -> None:
        """Every data-parallel replica runs the same number of forwards (dummy ones when idle)."""

        def work() -> Iterator[None]:
            for batch in batches:
                yield from batch.run()

        steps = work()
        alive = next(steps, False) is not False
        while True:
            flag = torch.tensor([1 if alive else 0], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._dp_group)
            if not int(flag):
                return
            if alive:
                alive = next(steps, False) is not False
                self.stats["forwards"] += 1
            else:
                self.decoder.dummy_forward()
                self.stats["idle_forwards"] += 1

    def _choose_decoder(self, backend: str):
        if backend not in ("auto", "megatron", "torch"):
            raise ValueError(f"rollout.backend must be auto, megatron or torch, got {backend!r}")
        routes = self._trainer.routes if self.record_routes else None
        megatron = MegatronDecoder(self.model, self.vocab_size, routes)
        if backend == "megatron":
            return megatron
        reason = torch_decoder_unsupported(self.model, self._trainer.config)
        if reason is None:
            fast = megatron_torch_decoder(
                self.model, self._trainer.config, self.vocab_size, self.record_routes
            )
            with self._trainer.generation_mode(record_routes=False):
                diff = check_against(
                    fast, MegatronDecoder(self.model, self.vocab_size), self.vocab_size
                )
            tol = 1e-5 if self._trainer.config.params_dtype == torch.float32 else 5e-2
            self.torch_decoder_check = diff
            if diff <= tol:
                return fast
            reason = f"its log-probs differ from GPTModel.forward's by {diff:.2e} > {tol:.0e}"
        if backend == "torch":
            raise ValueError(f"rollout.backend=torch cannot run this model: {reason}")
        return megatron

    def _generation_mode(self):
        """The torch decoder calls no module (dropout-free math): no autograd is all it needs."""
        if isinstance(self.decoder, MegatronDecoder):
            return self._trainer.generation_mode(self.record_routes)
        return torch.no_grad()
