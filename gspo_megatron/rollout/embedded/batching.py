"""Batched generation with a KV cache, shared by the embedded engine and the generator process.

No megatron import (the asynchronous generator process runs it). A generate call's sequences
(`make_sequences`) are sorted by prompt length and cut into batches of at most
`max_batch_tokens` cache slots (`plan_batches`); a `GenerationBatch` runs one batch with a
decoder (rollout/embedded/decoders.py, torch_decoder.py) and emits a `RolloutSample` per
sequence. The batch asks its `Generator` for new weights before every decode step
(`refresh_weights`): when they changed, every row's tokens so far are fed again under them and
generation goes on (a partial rollout), each token keeping the version that sampled it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gspo_megatron.rollout.base import RolloutSample, SamplingParams
from gspo_megatron.rollout.embedded.sampling import sample_tokens, sequence_uniforms


class Generator(Protocol):
    """What a `GenerationBatch` reads of the engine that runs it."""

    decoder: object
    device: torch.device
    record_routes: bool
    route_shape: tuple[int, int]
    weight_version: int
    tracks_versions: bool  # record each token's weight version

    def refresh_weights(self) -> bool:
        """Take newer weights if there are any (between two tokens); True when they changed."""
        ...


@dataclass
class GenerationSequence:
    key: int  # prompt index * n + sample index: the sample's place in the call's output
    prompt: list[int]
    budget: int  # response tokens allowed


class GenerationBatch:
    """One batch of sequences generated together with a static KV cache.

    Sequences live in "slots" (cache positions shared by all rows). Row b's prompt fills slots
    start[b] .. first[b]-1 and its response first[b] .. ; with a left-padding decoder the
    prompts are right-aligned (every response starts at the same slot), otherwise they start at
    slot 0 and rows with longer prompts are fed their own prompt tokens while others sample.
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
        longest = max(lengths)
        starts = [longest - n if self.decoder.left_pad else 0 for n in lengths]
        self.total = max(b + n + s.budget for b, n, s in zip(starts, lengths, seqs, strict=True))
        tokens = [
            [0] * b + s.prompt + [0] * (self.total - b - len(s.prompt))
            for b, s in zip(starts, seqs, strict=True)
        ]
        self.tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        self.start = torch.tensor(starts, dtype=torch.long, device=device)
        self.first = self.start + torch.tensor(lengths, device=device)
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
        self.swaps = 0
        stop_ids = sorted(set(params.stop_token_ids))
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
        self.routes = None
        if engine.record_routes:
            layers, topk = engine.route_shape
            shape = (rows, self.total, layers, topk)
            self.routes = torch.zeros(shape, dtype=torch.int32, device=device)
        self.results: dict[int, RolloutSample] = {}  # sequence key -> sample

    def run(self) -> Iterator[None]:
        """Yields before every model forward (the lock-step driver counts forwards)."""
        self.decoder.start(self.start, self.total)
        yield
        slot = int(self.first.min())
        logits = self._prefill(slot)
        while True:
            self._choose(slot, logits)
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
        """Prefill slots [0, length) once per distinct prompt prefix, then copy cache rows."""
        prefix = self.tokens[:, :length]
        keyed = torch.cat([self.start[:, None], prefix], dim=1)
        unique, inverse = torch.unique(keyed, dim=0, return_inverse=True)
        if unique.shape[0] == prefix.shape[0]:
            return self._forward(prefix, 0)
        firsts = torch.zeros(unique.shape[0], dtype=torch.long, device=prefix.device)
        firsts[inverse] = torch.arange(prefix.shape[0], device=prefix.device)
        self.decoder.select_rows(firsts)
        logits = self._forward(prefix[firsts], 0)
        self.decoder.select_rows(inverse)
        if self.routes is not None:
            self.routes[:, :length] = self.routes[inverse, :length]
        return logits[inverse]

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
        sampled = (slot >= self.first) & self.alive
        self.tokens[:, slot] = torch.where(sampled, tokens, self.tokens[:, slot])
        self.logprobs[:, slot] = logp
        if self.versions is not None:
            self.versions[:, slot] = self.engine.weight_version
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
        # one device-to-host copy per array
        tokens = self.tokens[done, :end].cpu()
        logprobs = self.logprobs[done, :end].cpu()
        routes = self.routes[done, : end - 1].cpu() if self.routes is not None else None
        versions = self.versions[done, :end].cpu() if self.versions is not None else None
        index = torch.stack(
            [self.rows[done], self.start[done], self.first[done], self.stopped[done].long()], 1
        ).tolist()
        for i, (seq, start, first, stopped) in enumerate(index):
            s = self.seqs[seq]
            self.results[s.key] = RolloutSample(
                prompt_ids=list(s.prompt),
                response_ids=tokens[i, first:].tolist(),
                logprobs=logprobs[i, first:].tolist(),
                finish_reason="stop" if stopped else "length",
                weight_version=self.engine.weight_version,
                routed_experts=None if routes is None else routes[i, start:].numpy().copy(),
                token_versions=None if versions is None else versions[i, first:].tolist(),
            )

    def _compact(self, keep: torch.Tensor) -> None:
        """Drop finished rows from the batch state and the KV cache."""
        for name in ("tokens", "logprobs", "start", "first", "end", "rows", "alive", "stopped"):
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
) -> list[GenerationSequence]:
    """The `len(prompts) * n` sequences of a generate call, prompts checked."""
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
        seqs.extend(GenerationSequence(p * n + j, ids, budget) for j in range(n))
    return seqs


def plan_batches(
    seqs: list[GenerationSequence], max_batch_tokens: int
) -> list[list[GenerationSequence]]:
    """Sort by prompt length; cut into batches of at most max_batch_tokens cache slots."""
    batches: list[list[GenerationSequence]] = []
    current: list[GenerationSequence] = []
    longest = 0
    for s in sorted(seqs, key=lambda s: len(s.prompt)):
        length = max(longest, len(s.prompt) + s.budget)
        if current and (len(current) + 1) * length > max_batch_tokens:
            batches.append(current)
            current, length = [], len(s.prompt) + s.budget
        current.append(s)
        longest = length
    if current:
        batches.append(current)
    return batches
