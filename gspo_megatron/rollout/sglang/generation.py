"""Generation over SGLang servers: jobs (one generate call, running on the client's event loop),
their batched /generate requests (resubmitted to another server on a fault, with the same seeds),
the weight versions a job accepts, and partial rollouts across a weight swap (rollout.mode=async:
an update aborts the requests in flight and they continue on the new weights). A job keeps its
samples in one place (`_Job`): a checkpoint reads them (`snapshot`), and a resumed run's job
continues them (`start(..., progress=)`: same seeds, the tokens recorded kept).

Prefix cache: every accepted answer's `meta_info.cached_tokens` (the input tokens SGLang's radix
cache held) is counted against its input tokens (`take_cache_metrics`): a multi-turn episode's
next turn should find its whole context but the last turn's final token and the observation.

Memory (docs/SGLANG.md, "Server memory"): a request holds its server's memory resident while it
runs (`MemoryCalls.hold`), and with offload_after_generate a job releases every server it did
not abandon a request on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gspo_megatron.event_loop import LoopThread, gather_or_cancel
from gspo_megatron.rollout.base import (
    FinishReason,
    JobProgress,
    JobStats,
    RolloutSample,
    SamplingParams,
)
from gspo_megatron.rollout.sglang.client import NO_RETRY, SGLangClient
from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
from gspo_megatron.rollout.sglang.memory import MEMORY_TAGS, MemoryCalls
from gspo_megatron.rollout.sglang.protocol import (
    GenerateOutput,
    SGLangConnectionError,
    SGLangError,
    SGLangHTTPError,
    SGLangProtocolError,
    SGLangTimeoutError,
    generate_body,
    parse_generate_response,
    sample_seeds,
)
from gspo_megatron.rollout.sglang.servers import ServerInfos, ServerPool, ServerState

logger = logging.getLogger(__name__)


def _parse_version(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


class WeightVersions:
    """The weights the servers hold, as jobs see them: `version`, the latest update's (0, and
    `updated` false, before the first: the servers' launch weights count), jobs waiting for a
    version, and the swap in progress (`swaps` counts updates that aborted requests in
    flight; `settled` is clear while one runs). Use it on the client's event loop."""

    def __init__(self) -> None:
        self.version = 0
        self.updated = False
        self.swaps = 0
        self._changed = asyncio.Condition()
        self.settled = asyncio.Event()
        self.settled.set()

    def set(self, version: int) -> None:
        self.version, self.updated = version, True

    async def wait_for(self, min_version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.updated or self.version >= min_version)

    def begin_swap(self) -> None:
        self.settled.clear()
        self.swaps += 1

    async def published(self) -> None:
        """An update ended: jobs waiting for a version, and aborted requests waiting for the
        new weights, go on."""
        async with self._changed:
            self._changed.notify_all()
        self.settled.set()

    def older(self, outs: Sequence[GenerateOutput], min_version: int) -> str | None:
        """The first weight version in `outs` older than `min_version` (or not a version this
        engine set)."""
        if not self.updated:
            return None
        for out in outs:
            if out.weight_version is None:
                continue
            version = _parse_version(out.weight_version)
            if version is None or version < min_version:
                return out.weight_version
        return None

    def of(self, out: GenerateOutput) -> int:
        parsed = None if out.weight_version is None else _parse_version(out.weight_version)
        return self.version if parsed is None else parsed


@dataclass
class _Response:
    """One sample's response over its requests: a partial rollout continues after a weight
    swap, each token keeping the log-prob and the weight version that sampled it."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "abort"
    version: int = 0  # the weights that answered last
    routed_experts: np.ndarray | None = None

    def extend(self, out: GenerateOutput, version: int) -> None:
        self.version = version
        self.ids += out.output_ids
        self.logprobs += out.logprobs
        self.versions += [version] * len(out.output_ids)
        self.finish_reason = out.finish_reason
        # A continued request's routes cover everything it was given again: the latest answer
        # holds the routes of every token, from the weights that finished the response.
        self.routed_experts = out.routed_experts

    @classmethod
    def of(cls, sample: RolloutSample) -> _Response:
        """A checkpoint's partial sample, to continue."""
        return cls(
            list(sample.response_ids),
            list(sample.logprobs),
            list(sample.versions()),
            sample.finish_reason,
            sample.weight_version,
            sample.routed_experts,
        )

    def sample(self, prompt: list[int]) -> RolloutSample:
        spans = len(set(self.versions)) > 1
        return RolloutSample(
            prompt_ids=list(prompt),
            response_ids=self.ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            weight_version=self.version,
            routed_experts=self.routed_experts,
            token_versions=self.versions if spans else None,
        )


@dataclass
class _Job:
    """One generate job's samples as they stand (flat: prompt-major), read by `snapshot`."""

    prompts: list[list[int]]  # per sample
    n: int
    responses: list[_Response]
    done: list[bool]

    @classmethod
    def start(cls, prompts: Sequence[Sequence[int]], n: int, progress: JobProgress | None) -> _Job:
        flat = [list(p) for p in prompts for _ in range(n)]
        if progress is None:
            return cls(flat, n, [_Response() for _ in flat], [False] * len(flat))
        samples = [s for group in progress.samples for s in group]
        done = [d for flags in progress.done for d in flags]
        return cls(flat, n, [_Response.of(s) for s in samples], done)

    def progress(self) -> JobProgress:
        samples = [r.sample(p) for p, r in zip(self.prompts, self.responses, strict=True)]
        rows = range(0, len(samples), self.n)
        return JobProgress(
            [samples[i : i + self.n] for i in rows], [self.done[i : i + self.n] for i in rows]
        )


def _routed_shape_from_model(model_path: str) -> tuple[int, int] | None:
    cfg_file = Path(model_path) / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if "num_hidden_layers" in cfg and "num_experts_per_tok" in cfg:
        return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])
    return None


def routed_shape(cfg: SGLangEngineConfig) -> tuple[int, int] | None:
    """(layers, top_k) of the routed experts the servers return, None when none are asked
    for: from the config, else a launched server's model's config.json."""
    if not cfg.return_routed_experts:
        return None
    if cfg.routed_experts_layers and cfg.routed_experts_top_k:
        return cfg.routed_experts_layers, cfg.routed_experts_top_k
    for lc in cfg.launch:
        if (shape := _routed_shape_from_model(lc.model_path)) is not None:
            return shape
    raise ValueError(
        "rollout.sglang.routed_experts_layers / routed_experts_top_k: set them (the model's "
        "num_hidden_layers and num_experts_per_tok) to decode routed experts"
    )


class Generation:
    """Generate jobs over the servers of `pool` (or through `router`), and the pause around a
    weight update that partial rollouts need. `reachable()`: the servers that answer;
    `routed_shape`: (layers, top_k) of the routed experts to ask for (`routed_shape(cfg)`)."""

    def __init__(
        self,
        cfg: SGLangEngineConfig,
        *,
        client: SGLangClient,
        pool: ServerPool,
        memory: MemoryCalls,
        infos: ServerInfos,
        loop: LoopThread,
        urls: Sequence[str],
        router: str | None,
        reachable: Callable[[], list[str]],
        routed_shape: tuple[int, int] | None,
        partial_rollouts: bool,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.pool = pool
        self.memory = memory
        self.infos = infos
        self.loop = loop
        self.urls = list(urls)
        self.router = router
        self.reachable = reachable
        self.partial_rollouts = partial_rollouts
        self.versions = WeightVersions()
        # lora_sync=adapter: the adapter name each /generate carries (None: the base weights)
        self.lora_path: Callable[[], str | None] = lambda: None
        self.routed_shape = routed_shape
        self._seed_rng = random.Random(cfg.seed)
        self._jobs: set[concurrent.futures.Future] = set()
        self.jobs_running = 0
        self._idle_since = time.monotonic()
        # Servers a /generate of the current job was abandoned on (it may still run there until
        # SGLang notices): their memory is not released after the job.
        self._abandoned: set[str] = set()
        # input tokens of accepted answers, those SGLang's prefix cache held, and the samples
        # whose server said nothing of it
        self._cache_counts = dict.fromkeys(("prompt", "cached", "unreported"), 0)

    # ---- jobs --------------------------------------------------------------------------------

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        min_version: int | None,
        progress: JobProgress | None = None,
    ) -> concurrent.futures.Future[list[list[RolloutSample]]]:
        """A job on the client's loop: `n` samples per prompt from weights of at least
        `min_version` (default: the current version); `progress` (a checkpoint's): continue
        those samples. Its future holds its `JobStats` as `job_stats`, its samples as they stand
        as `job` (`snapshot`)."""
        if n < 1:
            raise ValueError(f"samples per prompt must be >= 1, got {n}")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; SGLang rejects empty input_ids")
        stats = JobStats()
        floor = self.versions.version if min_version is None else min_version
        job = _Job.start(prompts, n, progress)
        future = self.loop.submit(self._job(job, params, floor, stats))
        future.job_stats = stats  # type: ignore[attr-defined]
        future.job = job  # type: ignore[attr-defined]
        self._jobs.add(future)
        future.add_done_callback(self._jobs.discard)
        return future

    async def snapshot(self, jobs: Sequence[concurrent.futures.Future]) -> list[JobProgress]:
        """The progress of `jobs` (futures of `start`) as the client holds it; on the loop, so
        no answer lands halfway through."""
        return [job.job.progress() for job in jobs]

    def busy(self) -> bool:
        return any(not job.done() for job in list(self._jobs))

    def cancel(self) -> None:
        """Cancel every job: their requests' connections close, and SGLang aborts them."""
        for job in list(self._jobs):
            job.cancel()

    async def _job(
        self, job: _Job, params: SamplingParams, min_version: int, stats: JobStats
    ) -> list[list[RolloutSample]]:
        if not job.prompts:
            return []
        submitted = time.monotonic()
        if self.jobs_running == 0:
            stats.idle_s = submitted - self._idle_since
        self.jobs_running += 1
        swaps = self.versions.swaps
        try:
            await self.versions.wait_for(min_version)
            started = time.monotonic()
            stats.weights_wait_s = started - submitted
            await self._generate_all(job, params, min_version, stats)
            stats.generate_s = time.monotonic() - started
            stats.weight_swaps = self.versions.swaps - swaps
            return job.progress().samples
        finally:
            self.jobs_running -= 1
            if self.jobs_running == 0:
                self._idle_since = time.monotonic()

    async def _generate_all(
        self, job: _Job, params: SamplingParams, min_version: int, stats: JobStats
    ) -> None:
        if self.router:
            # The router picks the workers: all of them hold their memory before it sends any.
            await self.memory.resume(self.reachable(), MEMORY_TAGS)
        base = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        seeds = sample_seeds(base, len(job.prompts))  # by the sample's place: a resume's too
        todo = [k for k, done in enumerate(job.done) if not done]
        step = self.cfg.samples_per_request
        chunks = [todo[s : s + step] for s in range(0, len(todo), step)]
        await gather_or_cancel(
            [self._generate_chunk(job, c, seeds, params, min_version, stats) for c in chunks]
        )
        if self.cfg.offload_after_generate and self.jobs_running == 1:
            await self._offload()

    async def _offload(self) -> None:
        """Release every server's memory after a job (offload_after_generate): each server that
        answered all its requests, so none of ours runs there (SGLang asserts it is idle)."""
        urls = [u for u in self.reachable() if u not in self._abandoned]
        for url in sorted(self._abandoned & set(self.urls)):
            logger.warning(
                "%s keeps its memory this time: a request abandoned there may still run "
                "(SGLang kills a server released while busy)",
                url,
            )
        self._abandoned.clear()
        await self.memory.release(urls, MEMORY_TAGS)

    async def _generate_chunk(
        self,
        job: _Job,
        todo: list[int],
        seeds: list[int],
        params: SamplingParams,
        min_version: int,
        stats: JobStats,
    ) -> None:
        """The samples `todo` of a job, one /generate request at a time. With partial rollouts,
        the samples that a weight swap aborted continue once the new weights are in: their
        prompt plus the tokens they have, the same seeds, the tokens they may still generate (no
        re-tokenisation); so do a checkpoint's partial samples."""
        responses = job.responses
        while todo:
            swaps = self.versions.swaps
            outs = await self._request(
                [job.prompts[i] + responses[i].ids for i in todo],
                [seeds[i] for i in todo],
                params,
                [params.max_new_tokens - len(responses[i].ids) for i in todo],
                min_version,
            )
            swapped = self.partial_rollouts and self.versions.swaps != swaps
            unfinished = []
            for i, out in zip(todo, outs, strict=True):
                response = responses[i]
                response.extend(out, self.versions.of(out))
                stats.sampled_tokens += len(out.output_ids)
                if not (swapped and out.finish_reason == "abort"):
                    job.done[i] = True
                    continue
                if response.ids and response.ids[-1] in params.stop_token_ids:
                    response.finish_reason = "stop"  # stopped as the swap came
                elif len(response.ids) >= params.max_new_tokens:
                    response.finish_reason = "length"
                else:
                    unfinished.append(i)
                    continue
                job.done[i] = True
            if unfinished:
                await self.versions.settled.wait()
            todo = unfinished

    # ---- requests ----------------------------------------------------------------------------

    async def _request(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams,
        max_new_tokens: list[int],
        min_version: int,
    ) -> list[GenerateOutput]:
        """One /generate request; on a server fault it goes to another healthy server with the
        same body (same seeds), at most rollout.sglang.max_resubmits times."""
        body = generate_body(
            prompts,
            seeds,
            params,
            return_routed_experts=self.routed_shape is not None,
            max_new_tokens=max_new_tokens,
        )
        for attempt in range(self.cfg.max_resubmits + 1):
            url = self.router or await self._acquire_held()
            if (adapter := self.lora_path()) is not None:
                body["lora_path"] = adapter  # the newest adapter (lora_sync=adapter)
            stale = False
            try:
                answer = await self._while_alive(url, self.client.post(url, "/generate", body))
            except (SGLangConnectionError, SGLangTimeoutError) as e:
                self._abandoned.add(url)
                error: SGLangError = e
            except asyncio.CancelledError:
                self._abandoned.add(url)
                raise
            except SGLangHTTPError as e:
                if e.status < 500:
                    raise
                error = e
            else:
                outs = parse_generate_response(
                    answer,
                    [len(p) for p in prompts],
                    url + "/generate",
                    routed_experts_shape=self.routed_shape,
                )
                old = self.versions.older(outs, min_version)
                if old is None:
                    self._count_cached(prompts, outs)
                    return outs
                # Samples of weights older than the job accepts are never used (a server
                # restarted behind a router, or one that missed an update): fence the server and
                # ask another.
                error = SGLangProtocolError(
                    f"{url} answered with weight version {old!r}, older than {min_version}", url
                )
                self.pool.counters["stale_answers"] += 1
                stale = url in self.pool.servers
                if stale:
                    self.pool.set(url, ServerState.STALE, str(error))
            finally:
                if url != self.router:
                    self.memory.unhold([url])
            if attempt == self.cfg.max_resubmits:
                raise error
            if not stale:
                self.pool.failed(url, str(error))
            self.pool.counters["requests_resubmitted"] += 1
            logger.warning("resubmitting %d samples (same seeds) after: %s", len(prompts), error)
        raise AssertionError("unreachable")

    def _count_cached(self, prompts: list[list[int]], outs: list[GenerateOutput]) -> None:
        counts = self._cache_counts
        for prompt, out in zip(prompts, outs, strict=True):
            if out.cached_tokens is None:
                counts["unreported"] += 1
            else:
                counts["prompt"] += len(prompt)
                counts["cached"] += out.cached_tokens

    def take_cache_metrics(self) -> dict[str, float]:
        """The prefix cache's share of the input tokens since the last call, as rollout/*
        metrics (the names the embedded engine's kept context reports); on the loop."""
        counts, self._cache_counts = self._cache_counts, dict.fromkeys(self._cache_counts, 0)
        prompt, cached = counts["prompt"], counts["cached"]
        return {
            "rollout/prefix_cache_reused_tokens": float(cached),
            "rollout/prefill_tokens": float(prompt - cached),
            "rollout/prefix_cache_reused_fraction": cached / prompt if prompt else 0.0,
            "rollout/prefix_cache_unreported": float(counts["unreported"]),
        }

    async def _acquire_held(self) -> str:
        """A healthy server (the least loaded), holding all its memory until `unhold`: released
        memory is resumed first; a server where that fails is suspect, and another one taken."""
        while True:
            url = await self.pool.acquire()
            if not await self.memory.hold([url], MEMORY_TAGS):
                return url

    async def _while_alive(self, url: str, request: Awaitable[Any]) -> Any:
        """`request`'s answer; while it runs the server's /health is checked, and a server that
        answers none for rollout.sglang.liveness_timeout_s fails the request at once."""
        deadline = self.cfg.liveness_timeout_s
        task = asyncio.ensure_future(request)
        if not deadline:
            return await task
        interval = min(10.0, deadline / 4)
        loop = asyncio.get_running_loop()
        last_alive = loop.time()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=interval)
                if done:
                    return task.result()
                if await self.memory.tracker.probe(url, interval):
                    last_alive = loop.time()
                elif loop.time() - last_alive >= deadline:
                    raise SGLangTimeoutError(
                        f"{url} answered no /health for {loop.time() - last_alive:.0f} s while "
                        "generating: hung or gone (rollout.sglang.liveness_timeout_s="
                        f"{deadline:g})",
                        url,
                    )
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, SGLangError):
                    await task

    async def holds_current_weights(self, url: str) -> bool:
        """Does `url` (answering again after a fault) hold the current weights? (/model_info)"""
        if not self.versions.updated:
            return True
        info = await self.client.get(url, "/model_info", retry=NO_RETRY, timeout_s=30.0)
        return isinstance(info, dict) and str(info.get("weight_version")) == str(
            self.versions.version
        )

    # ---- around a weight update --------------------------------------------------------------

    async def check_pause_mode(self, urls: Sequence[str]) -> None:
        """Partial rollouts need /pause_generation mode abort, which returns once the requests
        it aborted have ended: SGLang 0.5.6 and later (docs/SGLANG.md, "Asynchronous
        rollouts"). A server that does not answer is checked when it answers again."""
        if not self.partial_rollouts:
            return
        for url in urls:
            try:
                info = await self.infos.get(url)
            except SGLangError:
                continue
            release = str(info.get("version", ""))
            numbers = tuple(int(x) for x in re.findall(r"\d+", release)[:3])
            if numbers and numbers < (0, 5, 6):
                raise ValueError(
                    f"{url} runs SGLang {release}: rollout.mode=async needs SGLang >= 0.5.6 "
                    "(/pause_generation mode abort, waiting for the requests it aborts)"
                )

    def swap_due(self, every_server: bool) -> bool:
        """An update of every server while jobs run, with partial rollouts: their requests
        are aborted and continue on the new weights (otherwise SGLang holds the update until
        the requests running finish)."""
        return self.partial_rollouts and every_server and self.jobs_running > 0

    async def pause_for_swap(self, urls: Sequence[str]) -> list[str]:
        """Abort every request in flight (/pause_generation mode abort; they answer with the
        tokens they have, finish reason abort) and hold new ones until /continue_generation.
        Returns the servers paused; one that fails is suspect."""
        self.versions.begin_swap()
        return await self._control_each("/pause_generation", {"mode": "abort"}, urls)

    async def after_update(self, paused: Sequence[str]) -> None:
        """Paused servers generate again; jobs waiting for this version, and aborted requests
        waiting for the new weights, go on."""
        await self._control_each("/continue_generation", {}, paused)
        await self.versions.published()

    async def _control_each(self, path: str, body: dict, urls: Sequence[str]) -> list[str]:
        """`path` on each of `urls` (no retries): the servers that answered; one that fails is
        suspect."""
        answers = await self.client.post_each(path, dict.fromkeys(urls, body))
        for url, answer in answers.items():
            if isinstance(answer, SGLangError):
                self.pool.failed(url, f"{path}: {answer}")
            elif isinstance(answer, BaseException):
                raise answer
        return [u for u, a in answers.items() if not isinstance(a, BaseException)]
