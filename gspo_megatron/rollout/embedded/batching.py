"""Batched generation with a KV cache, shared by the embedded engine and the generator process.

No megatron import (the asynchronous generator process runs it). A generate call's sequences
(`make_sequences`) are sorted by prompt length and cut into batches of at most
`max_batch_tokens` cache slots (`plan_batches`); a `GenerationBatch` runs one batch with a
decoder (rollout/embedded/decoders.py, torch_decoder.py) and emits a `RolloutSample` per
sequence. The batch asks its `Generator` for new weights before every decode step
(`refresh_weights`): when they changed, every row's tokens so far are fed again under them and
generation goes on (a partial rollout), each token keeping the version that sampled it.

With a prefix cache (`Generator.prefix_cache`, rollout/embedded/prefix_cache.py) a finished
sequence's keys and values are kept, and a later prompt that starts with a kept sequence (the next
turn of a multi-turn episode) takes them into its row and prefills only the tokens after it.

A sequence may come with a `prefix`: the partial response of a job continued from a checkpoint
(or from a snapshot). Its tokens are fed like the prompt's, keep their log-probs and versions,
and sampling goes on at the next response position with the same per-sequence uniforms, so a
continued response is the one the uninterrupted sequence would have produced from there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gspo_megatron.rollout.base import RolloutSample, SamplingParams
from gspo_megatron.rollout.embedded.prefix_cache import KeptContext, PrefixCache
from gspo_megatron.rollout.embedded.sampling import sample_tokens, sequence_uniforms


class Generator(Protocol):
    """What a `GenerationBatch` reads of the engine that runs it."""

    decoder: object
    device: torch.device
    record_routes: bool
    route_shape: tuple[int, int]
    weight_version: int
    tracks_versions: bool  # record each token's weight version
    prefix_cache: PrefixCache | None  # contexts kept between calls (None: off)

    def refresh_weights(self) -> bool:
        """Take newer weights if there are any (between two tokens); True when they changed."""
        ...


@dataclass
class GenerationSequence:
    key: int  # prompt index * n + sample index: the sample's place in the call's output
    prompt: list[int]
    budget: int  # response tokens allowed (the prefix's included)
    prefix: RolloutSample | None = None  # a partial response to continue (not complete)

    @property
    def fed(self) -> int:
        """Tokens fed before the first one this batch samples."""
        return len(self.prompt) + (len(self.prefix.response_ids) if self.prefix else 0)


# Per-row state a compaction keeps in step.
_ROW_FIELDS = ("tokens", "logprobs", "start", "first", "resume", "end", "rows", "alive", "stopped")


class GenerationBatch:
    """One batch of sequences generated together with a static KV cache.

    Sequences live in "slots" (cache positions shared by all rows). Row b's prompt fills slots
    start[b] .. first[b]-1 and its response first[b] .. ; a continued row's prefix fills
    first[b] .. resume[b]-1 and sampling starts at resume[b] (= first[b] without a prefix).
    With a left-padding decoder the fed tokens are right-aligned (every row samples from the
    same slot on), otherwise they start at slot 0 and rows with more fed tokens are fed their
    own while others sample.
    """

    def __init__(
        self,
        engine: Generator,
        seqs: list[GenerationSequence],
        params: SamplingParams,
        seed: int,
    ) -> None:
        self.engine = engine
        self.decoder = engine.decoder
        self.seqs = seqs
        self.params = params
        device = engine.device
        rows = len(seqs)
        lengths = [len(s.prompt) for s in seqs]
        fed = [s.fed for s in seqs]
        longest = max(fed)
        starts = [longest - n if self.decoder.left_pad else 0 for n in fed]
        self.total = max(b + n + s.budget for b, n, s in zip(starts, lengths, seqs, strict=True))
        prefixes = [s.prefix.response_ids if s.prefix else [] for s in seqs]
        tokens = [
            [0] * b + s.prompt + done + [0] * (self.total - b - n)
            for b, s, done, n in zip(starts, seqs, prefixes, fed, strict=True)
        ]
        self.tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        self.start = torch.tensor(starts, dtype=torch.long, device=device)
        self.first = self.start + torch.tensor(lengths, device=device)
        self.resume = self.start + torch.tensor(fed, device=device)
        self.end = self.first + torch.tensor([s.budget for s in seqs], device=device)
        self.logprobs = torch.zeros(rows, self.total, dtype=torch.float32, device=device)
        # one uniform per response position; a fixed count keeps rows independent of batching
        uniforms = sequence_uniforms(seed, [s.key for s in seqs], params.max_new_tokens)
        self.uniforms = uniforms.to(device)
        self.rows = torch.arange(rows, device=device)  # batch row -> index into self.seqs
        self.alive = torch.ones(rows, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        # the weight version that sampled each token (tracked when the weights can change)
        self.versions = (
            torch.zeros(rows, self.total, dtype=torch.int64, device=device)
            if engine.tracks_versions
            else None
        )
        self._place_prefixes(seqs)
        self.swaps = 0
        self.sampled = torch.zeros((), dtype=torch.int64, device=device)  # tokens sampled
        self.slot = -1  # the last slot decided (every alive row's tokens up to it are known)
        stop_ids = sorted(set(params.stop_token_ids))
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
        self.routes = None
        if engine.record_routes:
            layers, topk = engine.route_shape
            shape = (rows, self.total, layers, topk)
            self.routes = torch.zeros(shape, dtype=torch.int32, device=device)
        self.results: dict[int, RolloutSample] = {}  # sequence key -> sample

    def _place_prefixes(self, seqs: list[GenerationSequence]) -> None:
        """Continued rows keep their tokens' log-probs and versions."""
        for row, s in enumerate(seqs):
            if not s.prefix or not s.prefix.response_ids:
                continue
            first = int(self.first[row])
            span = slice(first, first + len(s.prefix.response_ids))
            self.logprobs[row, span] = torch.tensor(s.prefix.logprobs, dtype=torch.float32)
            if self.versions is not None:
                self.versions[row, span] = torch.tensor(s.prefix.versions(), dtype=torch.int64)

    def run(self) -> Iterator[None]:
        """Yields before every model forward (the lock-step driver counts forwards)."""
        yield
        slot = int(self.resume.min())
        logits = self._prefill(slot)
        while True:
            self._choose(slot, logits)
            self.slot = slot
            if self._finish_rows(slot):
                return
            yield
            if self.engine.refresh_weights():
                # A partial rollout: new weights between two tokens. The rows' tokens so far
                # (prompt and partial response, as ids) are fed again under them; rows already
                # finished (kept until a compaction) are dropped first, not fed again.
                self.swaps += 1
                if not bool(self.alive.all()):
                    self._compact(self.alive.nonzero().flatten())
                self.decoder.start(self.start, self.total)
                logits = self._forward(self.tokens[:, : slot + 1], 0)
            else:
                logits = self._forward(self.tokens[:, slot : slot + 1], slot)
            slot += 1

    def _prefill(self, length: int) -> torch.Tensor:
        """Prefill slots [0, length) once per distinct prompt prefix (from where the context
        kept from earlier calls ends), then copy cache rows. The cache starts with the distinct
        prefixes' rows only (the same as starting every row and keeping those)."""
        prefix = self.tokens[:, :length]
        keyed = torch.cat([self.start[:, None], prefix], dim=1)
        unique, inverse = torch.unique(keyed, dim=0, return_inverse=True)
        firsts = None
        if unique.shape[0] < prefix.shape[0]:
            firsts = torch.zeros(unique.shape[0], dtype=torch.long, device=prefix.device)
            firsts[inverse] = torch.arange(prefix.shape[0], device=prefix.device)
        picked = firsts if firsts is not None else self.rows
        self.decoder.start(self.start if firsts is None else self.start[firsts], self.total)
        offset = self._reuse_context(picked.tolist(), length)
        logits = self._forward(prefix[picked, offset:], offset)
        if firsts is None:
            return logits
        self.decoder.select_rows(inverse)
        if self.routes is not None:
            self.routes[:, :length] = self.routes[inverse, :length]
        return logits[inverse]

    def _reuse_context(self, picked: list[int], length: int) -> int:
        """Load the kept context of each prefilled row (row i feeds sequence picked[i]); return
        the slot the prefill starts at: the first slot any row lacks. Rows ahead of it have the
        slots up to it loaded, and are fed the rest again (their own tokens)."""
        cache = self.engine.prefix_cache
        if cache is None:
            return 0
        counts = cache.counts
        if not getattr(self.decoder, "keeps_context", False):
            counts.unsupported += len(picked)
            counts.prefill_tokens += sum(self.seqs[row].fed for row in picked)
            return 0
        starts = self.start[picked].tolist()
        version = self.engine.weight_version
        kept: list[KeptContext | None] = []
        for row in picked:
            s = self.seqs[row]
            fed = s.prompt + (s.prefix.response_ids if s.prefix else [])
            kept.append(cache.lookup(fed, version))
        offset = min(start + len(k or ()) for start, k in zip(starts, kept, strict=True))
        for i, (start, k) in enumerate(zip(starts, kept, strict=True)):
            loaded = max(0, offset - start)
            counts.reused_tokens += loaded
            counts.prefill_tokens += length - max(offset, start)
            if not loaded:
                continue
            self.decoder.write_context(
                i, start, [t[:, :loaded] for t in k.keys], [t[:, :loaded] for t in k.values]
            )
            if self.routes is not None:
                self.routes[i, start : start + loaded] = k.routes[:loaded]
        return offset

    def _keep_contexts(self, done: list[int], starts: list[int], tokens, end: int) -> None:
        """Keep the K/V of finished rows (batch rows `done`; `tokens` their ids up to `end`):
        every slot from the row's start to the last one fed (end - 2; the last sampled token
        never was)."""
        cache = self.engine.prefix_cache
        if cache is None or not getattr(self.decoder, "keeps_context", False):
            return
        for i, (row, start) in enumerate(zip(done, starts, strict=True)):
            keys, values = self.decoder.read_context(row, start, end - 1 - start)
            routes = None
            if self.routes is not None:
                routes = self.routes[row, start : end - 1].clone()
            context = KeptContext(tokens[i, start : end - 1].tolist(), keys, values, routes)
            cache.keep(context, self.engine.weight_version)

    def _forward(self, tokens: torch.Tensor, offset: int) -> torch.Tensor:
        """Feed tokens [b, s] at positions offset.. ; return float32 logits [b, vocab]."""
        logits, routes = self.decoder.forward(tokens, offset)
        if self.routes is not None:
            rows, length = tokens.shape
            self.routes[:rows, offset : offset + length] = routes.to(torch.int32)
        return logits

    def _choose(self, slot: int, logits: torch.Tensor) -> None:
        """The token at `slot` of every row: its prompt token, or a sample from `logits`."""
        rel = (slot - self.first).clamp_(min=0, max=self.uniforms.shape[1] - 1)
        tokens, logp = sample_tokens(logits, self.params, self.uniforms[self.rows, rel])
        sampled = (slot >= self.resume) & self.alive
        self.tokens[:, slot] = torch.where(sampled, tokens, self.tokens[:, slot])
        self.logprobs[:, slot] = torch.where(sampled, logp, self.logprobs[:, slot])
        if self.versions is not None:
            version = torch.full_like(self.versions[:, slot], self.engine.weight_version)
            self.versions[:, slot] = torch.where(sampled, version, self.versions[:, slot])
        self.sampled += sampled.sum()
        if self.stop_ids.numel():
            self.stopped |= sampled & torch.isin(tokens, self.stop_ids)

    def _finish_rows(self, slot: int) -> bool:
        """Emit rows that stopped or reached their length; return True when all are done."""
        was_alive = self.alive
        self.alive = was_alive & ~self.stopped & (slot + 1 < self.end)
        done = was_alive & ~self.alive
        finished, alive = torch.stack([done.sum(), self.alive.sum()]).tolist()  # one sync
        if finished:
            self._emit(done.nonzero().flatten(), slot + 1)
        if alive == 0:
            return True
        if alive <= 0.75 * self.alive.numel():
            self._compact(self.alive.nonzero().flatten())
        return False

    def _emit(self, done: torch.Tensor, end: int) -> None:
        """Rows `done` are complete up to slot `end` (exclusive): make their samples."""
        # one device-to-host copy per array, and one conversion to Python lists per array; each
        # sample's routes are a view of its own row of the routes copied here
        tokens = self.tokens[done, :end].cpu()
        logprobs = self.logprobs[done, :end].tolist()
        routes = self.routes[done, : end - 1].cpu().numpy() if self.routes is not None else None
        versions = self.versions[done, :end].tolist() if self.versions is not None else None
        index = torch.stack(
            [self.rows[done], self.start[done], self.first[done], self.stopped[done].long()], 1
        ).tolist()
        self._keep_contexts(done.tolist(), [row[1] for row in index], tokens, end)
        token_lists = tokens.tolist()
        version = self.engine.weight_version
        for i, (seq, start, first, stopped) in enumerate(index):
            s = self.seqs[seq]
            self.results[s.key] = RolloutSample(
                prompt_ids=list(s.prompt),
                response_ids=token_lists[i][first:],
                logprobs=logprobs[i][first:],
                finish_reason="stop" if stopped else "length",
                weight_version=version,
                routed_experts=None if routes is None else routes[i, start:],
                token_versions=None if versions is None else versions[i][first:],
            )

    def partial(self) -> dict[int, RolloutSample]:
        """The rows not finished, by sequence key: their response tokens so far (after the last
        slot decided; a row still being fed its prefix has the prefix), each with its log-prob
        and version. Routes are left out: a continuation feeds the tokens again and records
        them anew."""
        out = {}
        alive = self.alive.nonzero().flatten().tolist()
        for row in alive:
            s = self.seqs[int(self.rows[row])]
            first, resume = int(self.first[row]), int(self.resume[row])
            end = max(self.slot + 1, resume)
            versions = (
                self.versions[row, first:end].tolist()
                if self.versions is not None
                else [self.engine.weight_version] * (end - first)
            )
            out[s.key] = RolloutSample(
                prompt_ids=list(s.prompt),
                response_ids=self.tokens[row, first:end].tolist(),
                logprobs=self.logprobs[row, first:end].tolist(),
                finish_reason="abort",
                weight_version=self.engine.weight_version,
                token_versions=versions,
            )
        return out

    def _compact(self, keep: torch.Tensor) -> None:
        """Drop finished rows from the batch state and the KV cache."""
        for name in _ROW_FIELDS:
            setattr(self, name, getattr(self, name)[keep])
        if self.routes is not None:
            self.routes = self.routes[keep]
        if self.versions is not None:
            self.versions = self.versions[keep]
        self.decoder.select_rows(keep)


def make_sequences(
    prompts: Sequence[Sequence[int]],
    n: int,
    params: SamplingParams,
    *,
    vocab_size: int,
    max_sequence_length: int,
    prefixes: dict[int, RolloutSample] | None = None,
) -> list[GenerationSequence]:
    """The `len(prompts) * n` sequences of a generate call, prompts checked; `prefixes`: key ->
    the partial response a sequence continues (keys absent from it start afresh)."""
    prefixes = prefixes or {}
    seqs = []
    for p, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {p} is empty: every prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(
                f"prompt {p} holds token ids outside [0, {vocab_size}) (model.vocab_size)"
            )
        room = max_sequence_length - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt {p} has {len(ids)} tokens, leaving no room to generate within the "
                f"maximum sequence length {max_sequence_length} "
                "(engine.max_sequence_length / model.max_position_embeddings)"
            )
        budget = min(params.max_new_tokens, room)
        for j in range(n):
            prefix = prefixes.get(p * n + j)
            if prefix is not None and len(prefix.response_ids) >= budget:
                raise ValueError(
                    f"prompt {p} sample {j}: a partial response of {len(prefix.response_ids)} "
                    f"tokens has no room left within {budget}; it is complete"
                )
            seqs.append(GenerationSequence(p * n + j, ids, budget, prefix))
    return seqs


def plan_batches(
    seqs: list[GenerationSequence], max_batch_tokens: int
) -> list[list[GenerationSequence]]:
    """Sort by tokens fed (the prompt, and a continued row's prefix); cut into batches of at most
    max_batch_tokens cache slots.

    A batch's slots per row: the longest prompt + budget; with continued rows, whose fed tokens
    are aligned, the most fed plus the most left to sample (a bound either way)."""
    batches: list[list[GenerationSequence]] = []
    current: list[GenerationSequence] = []
    plain = fed = left = 0  # of `current`: the longest prompt + budget, the most fed, left
    continued = False
    for s in sorted(seqs, key=lambda s: s.fed):
        whole = len(s.prompt) + s.budget
        s_fed = s.fed
        grown = (max(plain, whole), max(fed, s_fed), max(left, whole - s_fed))
        grown_continued = continued or s.prefix is not None
        slots = grown[1] + grown[2] if grown_continued else grown[0]
        if current and (len(current) + 1) * slots > max_batch_tokens:
            batches.append(current)
            current = []
            grown, grown_continued = (whole, s_fed, whole - s_fed), s.prefix is not None
        current.append(s)
        (plain, fed, left), continued = grown, grown_continued
    if current:
        batches.append(current)
    return batches
