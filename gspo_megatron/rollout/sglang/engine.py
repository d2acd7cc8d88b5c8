"""`SGLangEngine`: the RolloutEngine backed by SGLang servers (launched here or attached to).

The trainer calls it synchronously; inside, an event loop on a private thread runs the aiohttp
client, so generation fans out as concurrent batched /generate requests while weight sync can
block the caller's thread on a torch.distributed broadcast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from gspo_megatron.event_loop import LoopThread
from gspo_megatron.network import free_port
from gspo_megatron.rollout.base import (
    FinishReason,
    JobStats,
    RolloutSample,
    SamplingParams,
    WeightSource,
)
from gspo_megatron.rollout.sglang import weight_sync as ws
from gspo_megatron.rollout.sglang.client import NO_RETRY, RetryPolicy, SGLangClient, normalize_url
from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
from gspo_megatron.rollout.sglang.launcher import SGLangServerProcess
from gspo_megatron.rollout.sglang.memory import MEMORY_TAGS, MemoryRecord, MemoryTracker
from gspo_megatron.rollout.sglang.protocol import (
    GenerateOutput,
    SGLangConnectionError,
    SGLangError,
    SGLangHTTPError,
    SGLangProtocolError,
    SGLangTimeoutError,
    WeightUpdateError,
    generate_body,
    parse_generate_response,
    sample_seeds,
)
from gspo_megatron.rollout.sglang.servers import (
    HealthSettings,
    Server,
    ServerPool,
    ServerState,
    duration_text,
    wall_clock,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def _gather_or_cancel(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Like gather, but the first failure cancels the others before it propagates."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _refusal(answer: Any) -> str | None:
    """None when a weight-update answer says success, else the server's reason."""
    if isinstance(answer, dict) and answer.get("success") is True:
        return None
    return str(answer.get("message") if isinstance(answer, dict) else answer)


def _failure_reason(f: concurrent.futures.Future) -> str | None:
    """None when a finished weight-update request succeeded, else the reason."""
    if f.cancelled():
        return "cancelled"
    if (e := f.exception()) is not None:
        return str(e)
    return _refusal(f.result())


def _parse_version(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


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


def _routed_shape_from_model(model_path: str) -> tuple[int, int] | None:
    import json

    cfg_file = Path(model_path) / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if "num_hidden_layers" in cfg and "num_experts_per_tok" in cfg:
        return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])
    return None


class SGLangEngine:
    """RolloutEngine over SGLang servers. See docs/SGLANG.md for recipes.

    Every trainer rank may hold one. The leader's (rank 0's, the weight source's sender) launches
    and talks to the servers; the others only drive the weight source's collectives in
    `update_weights`. The trainer generates on the leader alone and shares the samples
    (gspo_megatron/rollout/driver.py), so fault handling decides once for all ranks.
    """

    generates_on_every_rank = False

    def __init__(
        self,
        cfg: SGLangEngineConfig,
        *,
        leader: bool = True,
        partial_rollouts: bool = False,
        memory_record: str | Path | None = None,
        announce: Callable[[str], None] | None = None,
        status_interval_s: float = 60.0,
    ) -> None:
        """`memory_record`: the file where the leader records which GPU memory of the servers it
        released (gspo-train: <run directory>/sglang_memory.json), for a run resumed in the same
        directory; None: no record (a server the engine has no record of counts as resident).
        `announce(line)` tells the user what a wait for servers waits for, at once and every
        `status_interval_s` (default: a warning in this module's log)."""
        cfg.validate()
        self.cfg = cfg
        self.leader = leader
        self._announce = announce or (lambda line: logger.warning("%s", line))
        self._status_interval_s = status_interval_s
        # rollout.mode=async: a weight update aborts the requests in flight (/pause_generation
        # mode abort) and continues them on the new weights. Otherwise it waits for them
        # (SGLang holds an update until the requests running finish).
        self.partial_rollouts = partial_rollouts
        self.version = 0
        self._updated = False  # before the first update the servers' launch weights count
        self._routed_shape = self._resolve_routed_shape()
        # Workers (weight sync, control calls) and where /generate goes.
        self.urls = [normalize_url(u) for u in cfg.urls] + [lc.url for lc in cfg.launch]
        self._router = normalize_url(cfg.router_url) if cfg.router_url else None
        self._gen_urls = [self._router] if self._router else self.urls
        self._seed_rng = random.Random(cfg.seed)
        self._server_info: dict[str, dict] = {}
        # Servers a /generate of the current job was abandoned on (it may still run there until
        # SGLang notices): their memory is not released after the job.
        self._abandoned: set[str] = set()
        self._group: torch.distributed.ProcessGroup | None = None
        self._group_urls: list[str] = []
        # A group broken by a failure cannot be destroyed safely (a peer may never answer):
        # its replacement gets a new name (group_name.1, .2, ...).
        self._group_name = cfg.group_name
        self._groups_dropped = 0
        self._disk_latest: tuple[int, Path] | None = None
        self._disk = (
            ws.DiskWriter(cfg.disk_dir, cfg.disk_base_model_path)
            if cfg.weight_sync == "disk" and cfg.disk_dir
            else None
        )
        self._servers: list[SGLangServerProcess] = []
        # Generate jobs (their futures), and what they wait on, on the client's loop.
        self._jobs: set[concurrent.futures.Future] = set()
        self._jobs_running = 0
        self._idle_since = time.monotonic()
        self._swaps = 0  # weight updates that aborted requests in flight
        self._version_changed = asyncio.Condition()
        self._weights_settled = asyncio.Event()
        self._weights_settled.set()
        self._client = SGLangClient(
            api_key=cfg.api_key,
            request_timeout_s=cfg.request_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            max_concurrency=cfg.max_concurrency,
            retry=RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.backoff_max_s),
        )
        record = MemoryRecord(memory_record) if leader and memory_record is not None else None
        self._memory = MemoryTracker(
            self._client, self.urls, record, call_timeout_s=cfg.weight_update_timeout_s
        )
        self._loop = LoopThread("sglang-client")
        self.pool = ServerPool(
            [],
            self._client,
            HealthSettings(
                check_interval_s=cfg.health_check_interval_s,
                restart_after_s=cfg.restart_after_s,
                startup_timeout_s=cfg.health_timeout_s,
                max_restarts=cfg.max_restarts,
                recovery_timeout_s=cfg.recovery_timeout_s,
            ),
            probe=self._memory.probe,
            unusable=self._memory.unknown,
            weights_current=self._holds_current_weights,
            on_restart=self._forget,
            announce=self._announce,
            status_interval_s=status_interval_s,
        )
        if not leader:
            return
        try:
            self._start_servers()
        except BaseException:
            self.close()
            raise
        launched = {p.url: p for p in self._servers}
        self.pool.servers = {u: Server(u, launched.get(u)) for u in self.urls}
        for url in self.urls:
            if (why := self._memory.unknown(url)) is not None:
                self.pool.set(url, ServerState.SUSPECT, why)
                self._announce(f"SGLang server {url}: {why}")

    # ---- setup -------------------------------------------------------------------------------

    def _resolve_routed_shape(self) -> tuple[int, int] | None:
        cfg = self.cfg
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

    def _start_servers(self) -> None:
        for i, lc in enumerate(self.cfg.launch):
            proc = SGLangServerProcess(lc, Path(self.cfg.log_dir) / f"sglang_{i}_{lc.port}.log")
            self._servers.append(proc)
            proc.start()
        self._run(self._await_startup({p.url: p for p in self._servers}))

    async def _await_startup(self, launched: dict[str, SGLangServerProcess]) -> None:
        """Wait until every server answers and its memory state is read (at most
        rollout.sglang.health_timeout_s), saying at once what it waits for and every
        status_interval_s how it stands. A launched server that exits fails it at once."""
        cfg = self.cfg
        targets = self.urls + ([self._router] if self._router else [])
        pending = dict.fromkeys(targets, "no answer yet")
        started = time.monotonic()
        until = wall_clock(time.time() + cfg.health_timeout_s)
        key = f"rollout.sglang.health_timeout_s={cfg.health_timeout_s:g}"
        poll = min(2.0, max(cfg.health_timeout_s / 10, 0.05))
        announced, next_status = False, 0.0

        def kind(url: str) -> str:
            if url == self._router:
                return "router"
            return "launched" if url in launched else "attached"

        def describe() -> str:
            return "; ".join(f"{u} ({kind(u)}): {why}" for u, why in pending.items())

        while True:
            for url in list(pending):
                proc = launched.get(url)
                if proc is not None and (why := proc.exit_reason()) is not None:
                    raise SGLangError(
                        f"SGLang server for {url} exited before becoming healthy: {why}", url
                    )
                why_not = await self._first_contact(url)
                if why_not is None:
                    del pending[url]
                else:
                    pending[url] = why_not
            if not pending:
                return
            now = time.monotonic()
            if now - started >= cfg.health_timeout_s:
                logs = "".join(f"; {launched[u].context()}" for u in pending if u in launched)
                hint = "" if set(pending) <= set(launched) else (
                    " (attached server: is it running, and is the URL right?)"
                )  # fmt: skip
                raise SGLangError(
                    f"SGLang server {', '.join(pending)} did not answer within "
                    f"{cfg.health_timeout_s:g} s ({key}): {describe()}{hint}{logs}",
                    next(iter(pending)),
                )
            if not announced:
                self._announce(f"waiting for SGLang servers to answer: {describe()}; until "
                               f"{until} ({key})")  # fmt: skip
                announced, next_status = True, now + self._status_interval_s
            elif now >= next_status:
                self._announce(f"still waiting for SGLang servers after "
                               f"{duration_text(now - started)} (until {until}, {key}): "
                               f"{describe()}")  # fmt: skip
                next_status += self._status_interval_s
            await asyncio.sleep(poll)

    async def _first_contact(self, url: str) -> str | None:
        """None once `url` is ready, else what it lacks. A server's memory state comes from its
        /server_info and the memory record; GET /health (a one-token generation in SGLang) waits
        for its warm-up only when everything is resident."""
        if url == self._router:
            return None if await self._client.is_healthy(url) else "no GET /health answer"
        if url not in self._server_info:
            try:
                info = await self._client.get(url, "/server_info", retry=NO_RETRY, timeout_s=5.0)
            except SGLangHTTPError as e:
                if e.status in (401, 403):  # waiting would not change that
                    raise SGLangHTTPError(
                        f"{e} (is rollout.sglang.api_key right?)", url, e.status, e.reason
                    ) from e
                return f"GET /server_info answered HTTP {e.status}"
            except SGLangError:
                return "no GET /server_info answer"
            if not isinstance(info, dict):
                raise SGLangProtocolError(f"{url}/server_info is not a JSON object", url)
            await self._memory.adopt(url, info)
            self._server_info[url] = info
        if not self._memory.resident(url):
            return None  # never GET /health: its model must not run
        if await self._client.is_healthy(url):
            return None
        return "answers GET /server_info, GET /health not 200 yet (warming up)"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        """`n` samples for each prompt, grouped per prompt in prompt order."""
        return self.start_generate(prompts, n, params).result()

    def start_generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        min_version: int | None = None,
        urgent: bool = False,
    ) -> concurrent.futures.Future[list[list[RolloutSample]]]:
        """`generate` running on the client's loop; the caller may update weights meanwhile
        (stale servers': `servers_to_resync`, `update_weights(..., urls=...)`; every server's,
        rollout.mode one_step_off / async). Its future holds the job's `JobStats` as `job_stats`.

        The job's requests start once the engine's weights are at least `min_version` (default:
        the current version), and an answer from older weights is never used. `urgent` (the
        generator process jumps its queue with it) changes nothing here: every job's requests
        share the servers at once, so none waits behind another.
        """
        del urgent
        if not self.leader:
            raise RuntimeError("SGLangEngine.generate runs on the leader (rank 0) only")
        if n < 1:
            raise ValueError(f"samples per prompt must be >= 1, got {n}")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; SGLang rejects empty input_ids")
        stats = JobStats()
        floor = self.version if min_version is None else min_version
        future = self._loop.submit(self._agenerate(prompts, n, params, floor, stats))
        future.job_stats = stats  # type: ignore[attr-defined]
        self._jobs.add(future)
        future.add_done_callback(self._jobs.discard)
        return future

    async def _agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        min_version: int,
        stats: JobStats,
    ) -> list[list[RolloutSample]]:
        if not prompts:
            return []
        submitted = time.monotonic()
        if self._jobs_running == 0:
            stats.idle_s = submitted - self._idle_since
        self._jobs_running += 1
        swaps = self._swaps
        try:
            async with self._version_changed:
                await self._version_changed.wait_for(
                    lambda: not self._updated or self.version >= min_version
                )
            started = time.monotonic()
            stats.weights_wait_s = started - submitted
            samples = await self._generate_all(prompts, n, params, min_version)
            stats.generate_s = time.monotonic() - started
            stats.weight_swaps = self._swaps - swaps
            return samples
        finally:
            self._jobs_running -= 1
            if self._jobs_running == 0:
                self._idle_since = time.monotonic()

    async def _generate_all(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams, min_version: int
    ) -> list[list[RolloutSample]]:
        if self._router:
            # The router picks the workers: all of them hold their memory before it sends any.
            await self._resume(self._reachable(), MEMORY_TAGS)
        flat_prompts = [list(p) for p in prompts for _ in range(n)]
        base = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        seeds = sample_seeds(base, len(flat_prompts))
        step = self.cfg.samples_per_request
        chunks = [
            range(s, min(s + step, len(flat_prompts))) for s in range(0, len(flat_prompts), step)
        ]
        results = await _gather_or_cancel(
            [
                self._generate_chunk(
                    [flat_prompts[k] for k in c], [seeds[k] for k in c], params, min_version
                )
                for c in chunks
            ]
        )
        samples = [s for chunk in results for s in chunk]
        if self.cfg.offload_after_generate and self._jobs_running == 1:
            await self._offload()
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    async def _offload(self) -> None:
        """Release every server's memory after a job (offload_after_generate): each server that
        answered all its requests, so none of ours runs there (SGLang asserts it is idle)."""
        urls = [u for u in self._reachable() if u not in self._abandoned]
        for url in sorted(self._abandoned & set(self.urls)):
            logger.warning(
                "%s keeps its memory this time: a request abandoned there may still run "
                "(SGLang kills a server released while busy)",
                url,
            )
        self._abandoned.clear()
        await self._release(urls, MEMORY_TAGS)

    async def _generate_chunk(
        self, prompts: list[list[int]], seeds: list[int], params: SamplingParams, min_version: int
    ) -> list[RolloutSample]:
        """The samples of one /generate request. With partial rollouts, the samples that a
        weight swap aborted continue once the new weights are in: their prompt plus the tokens
        they have, the same seeds, the tokens they may still generate (no re-tokenisation)."""
        responses = [_Response() for _ in prompts]
        todo = list(range(len(prompts)))
        while todo:
            swaps = self._swaps
            outs = await self._request(
                [prompts[i] + responses[i].ids for i in todo],
                [seeds[i] for i in todo],
                params,
                [params.max_new_tokens - len(responses[i].ids) for i in todo],
                min_version,
            )
            swapped = self.partial_rollouts and self._swaps != swaps
            unfinished = []
            for i, out in zip(todo, outs, strict=True):
                response = responses[i]
                response.extend(out, self._version_of(out))
                if not (swapped and out.finish_reason == "abort"):
                    continue
                if response.ids and response.ids[-1] in params.stop_token_ids:
                    response.finish_reason = "stop"  # stopped as the swap came
                elif len(response.ids) >= params.max_new_tokens:
                    response.finish_reason = "length"
                else:
                    unfinished.append(i)
            if unfinished:
                await self._weights_settled.wait()
            todo = unfinished
        return [r.sample(p) for p, r in zip(prompts, responses, strict=True)]

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
            return_routed_experts=self._routed_shape is not None,
            max_new_tokens=max_new_tokens,
        )
        for attempt in range(self.cfg.max_resubmits + 1):
            url = self._router or await self._acquire_held()
            stale = False
            try:
                answer = await self._while_alive(url, self._client.post(url, "/generate", body))
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
                    routed_experts_shape=self._routed_shape,
                )
                old = self._older_weights(outs, min_version)
                if old is None:
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
                if url != self._router:
                    self._memory.unhold([url])
            if attempt == self.cfg.max_resubmits:
                raise error
            if not stale:
                self.pool.failed(url, str(error))
            self.pool.counters["requests_resubmitted"] += 1
            logger.warning("resubmitting %d samples (same seeds) after: %s", len(prompts), error)
        raise AssertionError("unreachable")

    async def _acquire_held(self) -> str:
        """A healthy server (the least loaded), holding all its memory until `unhold`: released
        memory is resumed first; a server where that fails is suspect, and another one taken."""
        while True:
            url = await self.pool.acquire()
            if not await self._hold([url], MEMORY_TAGS):
                return url

    def _older_weights(self, outs: Sequence[GenerateOutput], min_version: int) -> str | None:
        """The first weight version in `outs` older than `min_version` (or not a version this
        engine set)."""
        if not self._updated:
            return None
        for out in outs:
            if out.weight_version is None:
                continue
            version = _parse_version(out.weight_version)
            if version is None or version < min_version:
                return out.weight_version
        return None

    def _version_of(self, out: GenerateOutput) -> int:
        parsed = None if out.weight_version is None else _parse_version(out.weight_version)
        return self.version if parsed is None else parsed

    # ---- server faults -----------------------------------------------------------------------

    async def _holds_current_weights(self, url: str) -> bool:
        if not self._updated:
            return True
        info = await self._client.get(url, "/model_info", retry=NO_RETRY, timeout_s=30.0)
        return isinstance(info, dict) and str(info.get("weight_version")) == str(self.version)

    def _forget(self, url: str) -> None:
        """A restarted server: its cached info, its released memory, and any weight-update group
        with it, are gone."""
        self._server_info.pop(url, None)
        self._memory.forget(url)
        if url in self._group_urls:
            self._drop_group()

    def _drop_group(self) -> None:
        self._group, self._group_urls = None, []
        self._groups_dropped += 1

    @property
    def resync_poll_s(self) -> float:
        """How often a caller waiting on `start_generate` asks `servers_to_resync`."""
        return min(5.0, self.cfg.health_check_interval_s)

    def servers_to_resync(self) -> list[str]:
        """Stale servers that answer and are due for a full weight update (the caller runs
        `update_weights(source, version, urls=...)` on every rank). A launched server whose
        updates failed twice running is restarted instead."""
        if not self.leader or not self._updated:
            return []

        async def due() -> list[str]:
            now, out = time.monotonic(), []
            for url in self.pool.in_state(ServerState.STALE):
                server = self.pool.servers[url]
                if server.process is not None and server.resync_failures >= 2:
                    await self.pool.restart(url, "its weight updates keep failing")
                elif not server.resync_failures or (
                    now - server.last_resync >= self.cfg.health_check_interval_s
                ):
                    out.append(url)
            return out

        return self._run(due())

    def fault_metrics(self) -> dict[str, float]:
        """Counts since the last call (restarts, resubmitted requests, ...) and the number of
        healthy servers, as rollout/* metrics (the leader's; empty elsewhere)."""
        if not self.leader:
            return {}

        async def take() -> dict[str, float]:
            out = {f"rollout/{k}": float(v) for k, v in self.pool.take_counters().items()}
            out["rollout/servers_healthy"] = float(len(self.pool.serving()))
            return out

        return self._run(take())

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
                if await self._memory.probe(url, interval):
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

    # ---- control -----------------------------------------------------------------------------

    async def _post_all(self, path: str, body: dict, *, expect_json: bool = True) -> list[Any]:
        """`path` on every server that answers (healthy or stale); the first failure raises."""
        return await _gather_or_cancel(
            [self._client.post(u, path, body, expect_json=expect_json) for u in self._reachable()]
        )

    def pause(self) -> None:
        """POST /pause_generation (mode `pause_mode`) on every server."""
        self._run(self._post_all("/pause_generation", {"mode": self.cfg.pause_mode}))

    def resume(self) -> None:
        """POST /continue_generation on every server."""
        self._run(self._post_all("/continue_generation", {}))

    def flush_cache(self) -> None:
        """POST /flush_cache on every server (SGLang refuses while requests run: raises)."""
        self._run(self._post_all("/flush_cache", {}, expect_json=False))

    def abort_all(self) -> None:
        """POST /abort_request {abort_all: true}: running requests end with finish reason abort."""
        self._run(self._post_all("/abort_request", {"abort_all": True}, expect_json=False))

    def health(self) -> bool:
        """Every server and the router answer (never by running the model of a server whose
        memory is released)."""

        async def check() -> bool:
            oks = await asyncio.gather(
                *(self._memory.probe(u, 5.0) for u in self.urls),
                *([self._client.is_healthy(self._router)] if self._router else []),
            )
            return all(oks)

        return self._run(check())

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the servers' GPU memory for `tags` (colocated training; needs
        --enable-memory-saver). Released tags come back automatically when needed. Only while
        nothing generates: SGLang kills a server asked to release while it is busy."""
        if any(not job.done() for job in list(self._jobs)):
            raise RuntimeError(
                "SGLangEngine.release_memory while a generate job runs: SGLang 0.5.23 asserts the "
                "server is idle and exits when it is not"
            )
        self._run(self._release(self._reachable(), tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Bring back the released ones of `tags` on every server that answers."""
        self._run(self._resume(self._reachable(), tags))

    def _reachable(self) -> list[str]:
        """Servers that answer (healthy or stale): the targets of control calls."""
        if not self.pool.servers:
            return list(self.urls)
        return self.pool.in_state(ServerState.HEALTHY, ServerState.STALE)

    async def _release(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        return self._memory_failed(
            "/release_memory_occupation", await self._memory.release(urls, tags)
        )

    async def _hold(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        return self._memory_failed("/resume_memory_occupation", await self._memory.hold(urls, tags))

    async def _resume(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        return self._memory_failed(
            "/resume_memory_occupation", await self._memory.resume(urls, tags)
        )

    def _memory_failed(self, path: str, failed: dict[str, SGLangError]) -> dict[str, SGLangError]:
        """Servers whose memory call failed are suspect: one whose state is now unknown gets
        nothing until it restarts (a launched one is restarted)."""
        for url, error in failed.items():
            self.pool.failed(url, self._memory.unknown(url) or f"{path}: {error}")
        return failed

    # ---- weight sync -------------------------------------------------------------------------

    def update_weights(
        self, source: WeightSource | None, version: int, urls: Sequence[str] | None = None
    ) -> None:
        """Load the policy from `source` into the servers and tag later samples with `version`.

        `urls`: only these servers (re-syncing stale ones); default: every server that answers
        (healthy or stale; the others are checked against `version` when they answer again).
        A server that fails is fenced: `stale` when it refused (SGLang warns that a failed
        update can leave partial weights), `suspect` when unreachable; it generates nothing
        until a full update reaches it. Raises WeightUpdateError, with the reasons, only when
        every target failed. Every trainer rank calls this (the source's collectives).
        """
        if source is None:
            raise ValueError("SGLangEngine.update_weights needs a WeightSource (got None)")
        if not (self.leader and source.is_sender()):
            for _ in source.buckets(self.cfg.bucket_bytes):
                pass  # the collectives inside the source need every rank
            self.version, self._updated = version, True
            return
        if not self.urls:
            raise ValueError(
                "weight sync needs the servers' own URLs (rollout.sglang.urls or launch), not "
                "only the router"
            )
        t0 = time.perf_counter()
        targets = list(self._reachable() if urls is None else urls)
        if self.partial_rollouts:
            self._run(self._require_abort_pause(targets))
        swap = self.partial_rollouts and urls is None and self._jobs_running > 0
        mode = self.cfg.weight_sync
        paused: list[str] = []
        held: list[str] = []
        try:
            if swap:
                paused = self._run(self._pause_for_swap(targets))
            live = [u for u in targets if u in self._reachable()]
            failures: dict[str, SGLangError] = {
                u: SGLangConnectionError(f"{u} did not answer", u) for u in targets if u not in live
            }
            # Never load into released weights (SGLang would write to unmapped memory), nor
            # release them while loading.
            failures.update(self._run(self._hold(live, ("weights",))))
            live = [u for u in live if u not in failures]
            held = list(live)
            if mode == "tensor":
                self._update_tensor(source, version, live, failures)
            elif mode == "distributed":
                self._update_distributed(source, version, live, failures)
            else:
                self._update_disk(source, version, live, failures)
            self.version, self._updated = version, True
            self._run(self._settle(targets, failures, version))
        finally:
            self._run(self._after_update(paused, held))
        if targets and len(failures) == len(targets):
            reasons = "; ".join(str(e) for e in failures.values())
            raise WeightUpdateError(
                f"weight update to version {version} ({mode}) failed on every server: "
                f"{reasons}. They generate nothing until a full update succeeds.",
                targets[0],
            )
        logger.info(
            "SGLang weights -> version %d (%s) on %d of %d servers in %.2f s",
            version, mode, len(targets) - len(failures), len(targets),
            time.perf_counter() - t0,
        )  # fmt: skip

    async def _require_abort_pause(self, urls: Sequence[str]) -> None:
        """Partial rollouts need /pause_generation mode abort, which returns once the requests
        it aborted have ended: SGLang 0.5.6 and later (docs/SGLANG.md, "Asynchronous
        rollouts"). A server that does not answer is checked when it answers again."""
        for url in urls:
            try:
                info = await self._info(url)
            except SGLangError:
                continue
            release = str(info.get("version", ""))
            numbers = tuple(int(x) for x in re.findall(r"\d+", release)[:3])
            if numbers and numbers < (0, 5, 6):
                raise ValueError(
                    f"{url} runs SGLang {release}: rollout.mode=async needs SGLang >= 0.5.6 "
                    "(/pause_generation mode abort, waiting for the requests it aborts)"
                )

    async def _pause_for_swap(self, urls: Sequence[str]) -> list[str]:
        """Partial rollouts: abort every request in flight (/pause_generation mode abort; they
        answer with the tokens they have, finish reason abort) and hold new ones until
        /continue_generation. Returns the servers paused; one that fails is suspect."""
        self._weights_settled.clear()
        self._swaps += 1
        return await self._control_each("/pause_generation", {"mode": "abort"}, urls)

    async def _after_update(self, paused: Sequence[str], held: Sequence[str]) -> None:
        """The weights may be released again; paused servers generate again; jobs waiting for
        this version, and aborted requests waiting for the new weights, go on."""
        self._memory.unhold(held)
        await self._control_each("/continue_generation", {}, paused)
        async with self._version_changed:
            self._version_changed.notify_all()
        self._weights_settled.set()

    async def _control_each(self, path: str, body: dict, urls: Sequence[str]) -> list[str]:
        """`path` on each of `urls` (no retries): the servers that answered; one that fails is
        suspect."""
        answers = await self._post_each(path, dict.fromkeys(urls, body))
        for url, answer in answers.items():
            if isinstance(answer, SGLangError):
                self.pool.failed(url, f"{path}: {answer}")
            elif isinstance(answer, BaseException):
                raise answer
        return [u for u, a in answers.items() if not isinstance(a, BaseException)]

    async def _settle(
        self, targets: Sequence[str], failures: dict[str, SGLangError], version: int
    ) -> None:
        now = time.monotonic()
        for url in targets:
            server = self.pool.servers[url]
            server.last_resync = now
            if url not in failures:
                server.resync_failures = 0
                self.pool.set(url, ServerState.HEALTHY, f"holds version {version}")
                continue
            error = failures[url]
            server.resync_failures += 1
            self.pool.counters["weight_update_failures"] += 1
            reason = f"weight update to version {version} failed: {error}"
            unreachable = isinstance(error, (SGLangConnectionError, SGLangTimeoutError))
            if unreachable or self._memory.unknown(url):
                self.pool.failed(url, reason)
            else:
                self.pool.set(url, ServerState.STALE, reason)

    async def _post_each(
        self, path: str, bodies: dict[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """One request per server (no retries): its answer, or the exception it raised."""
        answers = await asyncio.gather(
            *(
                self._client.post(u, path, b, retry=NO_RETRY, timeout_s=timeout_s)
                for u, b in bodies.items()
            ),
            return_exceptions=True,
        )
        return dict(zip(bodies, answers, strict=True))

    @staticmethod
    def _drop_failed(
        path: str, answers: dict[str, Any], live: list[str], failures: dict[str, SGLangError]
    ) -> None:
        """Move servers whose answer is not a success from `live` to `failures`."""
        for url, ans in answers.items():
            if isinstance(ans, SGLangError):
                failures[url] = ans
            elif isinstance(ans, BaseException):
                raise ans
            elif (reason := _refusal(ans)) is not None:
                failures[url] = WeightUpdateError(f"{url}{path} failed: {reason}", url)
            else:
                continue
            live.remove(url)

    async def _info(self, url: str) -> dict:
        if url not in self._server_info:
            info = await self._client.get(url, "/server_info")
            if not isinstance(info, dict):
                raise SGLangProtocolError(f"{url}/server_info is not a JSON object", url)
            self._server_info[url] = info
        return self._server_info[url]

    async def _tp_sizes(self, live: list[str], failures: dict[str, SGLangError]) -> dict[str, int]:
        infos = await asyncio.gather(*(self._info(u) for u in live), return_exceptions=True)
        sizes = {}
        for url, info in zip(list(live), infos, strict=True):
            if isinstance(info, SGLangError):
                failures[url] = info
                live.remove(url)
                continue
            if isinstance(info, BaseException):
                raise info
            if int(info.get("dp_size", 1)) != 1:
                raise ValueError(
                    f"{url} runs dp_size={info['dp_size']}; SGLang refuses "
                    f"{self.cfg.weight_sync} weight updates with dp_size > 1: run one server per "
                    "replica with dp_size=1"
                )
            if int(info.get("pp_size", 1)) != 1:
                raise ValueError(
                    f"{url} runs pp_size={info['pp_size']}; {self.cfg.weight_sync} weight sync "
                    "supports pp_size=1 servers only (use weight_sync=disk)"
                )
            sizes[url] = int(info.get("tp_size", 1))
        return sizes

    async def _begin_session(self, live: list[str], failures: dict[str, SGLangError]) -> None:
        """/begin_weight_update on every live server. A session that an earlier failed or
        killed update left open is ended first (SGLang refuses a second begin): the full update
        that follows replaces whatever it had loaded, and the server serves nothing until then."""
        path = "/begin_weight_update"

        def left_open(reason: str) -> bool:
            return "already open" in reason

        async def begin(url: str) -> Any:
            try:
                answer = await self._client.post(url, path, {}, retry=NO_RETRY)
                refused = isinstance(answer, dict) and answer.get("success") is not True
                if not (refused and left_open(str(answer.get("message")))):
                    return answer
            except SGLangHTTPError as e:
                if not left_open(e.reason):
                    raise
            logger.warning("%s: closing a weight-update session an earlier update left open", url)
            ended = await self._client.post(url, "/end_weight_update", {}, retry=NO_RETRY)
            if not (isinstance(ended, dict) and ended.get("success") is True):
                return ended
            return await self._client.post(url, path, {}, retry=NO_RETRY)

        answers = await asyncio.gather(*(begin(u) for u in live), return_exceptions=True)
        self._drop_failed(path, dict(zip(list(live), answers, strict=True)), live, failures)

    def _end_session(self, live: list[str], failures: dict[str, SGLangError]) -> None:
        path = "/end_weight_update"
        if live:
            self._drop_failed(path, self._run(self._post_each(path, dict.fromkeys(live, {}))),
                              live, failures)  # fmt: skip

    def _update_tensor(
        self, source: WeightSource, version: int, live: list[str], failures: dict
    ) -> None:
        tp = self._run(self._tp_sizes(live, failures))
        path = "/update_weights_from_tensor"
        self._run(self._begin_session(live, failures))
        for bucket in source.buckets(self.cfg.bucket_bytes):
            if not live:
                continue  # the source's collectives still need this rank
            bodies, keep_alive = {}, []
            for url in live:
                bodies[url], flat = ws.tensor_update_body(bucket, tp[url], str(version))
                keep_alive.append(flat)  # payloads point at this memory until answered
            answers = self._run(
                self._post_each(path, bodies, timeout_s=self.cfg.weight_update_timeout_s)
            )
            self._drop_failed(path, answers, live, failures)
            del keep_alive
        self._end_session(live, failures)

    def _init_group(self, tp: dict[str, int], urls: list[str]) -> torch.distributed.ProcessGroup:
        cfg = self.cfg
        port = cfg.master_port or free_port()
        world = 1 + sum(tp[u] for u in urls)
        if self._groups_dropped:
            self._run(self._destroy_group(urls, missing_ok=True))  # the broken one, if any
            self._group_name = f"{cfg.group_name}.{self._groups_dropped}"
        offsets, next_rank = {}, 1
        for url in urls:
            offsets[url] = next_rank
            next_rank += tp[url]
        # A group of this name left by an earlier trainer that died would make the init fail.
        self._run(self._destroy_group(urls, missing_ok=True))
        path = "/init_weights_update_group"
        futures = [
            self._loop.submit(
                self._client.post(
                    url,
                    path,
                    ws.init_weights_update_group_body(
                        cfg.master_address,
                        port,
                        offsets[url],
                        world,
                        self._group_name,
                        cfg.group_backend,
                    ),
                    retry=NO_RETRY,
                    timeout_s=cfg.weight_update_timeout_s,
                )
            )
            for url in urls
        ]
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = ws.init_custom_process_group(
                    backend=cfg.group_backend,
                    init_method=f"tcp://{cfg.master_address}:{port}",
                    world_size=world,
                    rank=0,
                    group_name=self._group_name,
                    timeout=timedelta(seconds=cfg.weight_update_timeout_s),
                )
            except Exception as e:  # noqa: BLE001 - reported below
                box["error"] = e

        joiner = threading.Thread(target=join, name="weight-group-join", daemon=True)
        joiner.start()
        self._await_servers(lambda: not joiner.is_alive(), futures, path, urls)
        if "error" in box:
            raise WeightUpdateError(
                f"joining the weight-update group at {cfg.master_address}:{port} (world "
                f"{world}) failed: {box['error']}"
            ) from box["error"]
        for url, f in zip(urls, futures, strict=True):
            if (reason := _failure_reason(f)) is not None:
                raise WeightUpdateError(f"{url}{path} failed: {reason}", url)
        group = box["group"]
        logger.info("weight-update group %s: world %d at port %d", self._group_name, world, port)
        return group

    def _await_servers(
        self,
        done: Callable[[], bool],
        futures: Sequence[concurrent.futures.Future],
        path: str,
        urls: Sequence[str],
    ) -> None:
        """Wait for a local transfer (`done()`) while its HTTP requests run. A server that
        refuses never joins the transfer: fail at once with its reason instead of waiting for
        the process-group timeout."""
        while not done():
            for url, f in zip(urls, futures, strict=True):
                if f.done():
                    reason = _failure_reason(f)
                    if reason is not None:
                        for g in futures:
                            g.cancel()
                        raise WeightUpdateError(f"{url}{path} failed: {reason}", url)
            time.sleep(0.001)

    async def _destroy_group(self, urls: Sequence[str], *, missing_ok: bool) -> None:
        """POST /destroy_weights_update_group on `urls` (sglang answers 400 "does not exist"
        when there is none; ignored with `missing_ok`)."""
        body = {"group_name": self._group_name}
        answers = await asyncio.gather(
            *(
                self._client.post(u, "/destroy_weights_update_group", body, retry=NO_RETRY,
                                  timeout_s=60.0)
                for u in urls
            ),
            return_exceptions=True,
        )  # fmt: skip
        for url, ans in zip(urls, answers, strict=True):
            if isinstance(ans, BaseException):
                gone = isinstance(ans, SGLangHTTPError) and "does not exist" in ans.reason
                if not (missing_ok and gone):
                    logger.warning("destroying the weight-update group on %s: %s", url, ans)

    def _update_distributed(
        self, source: WeightSource, version: int, live: list[str], failures: dict
    ) -> None:
        """One broadcast group with the trainer's sender and every live server. The servers of
        a broadcast move together: any failure leaves them all out of step (fenced), and the
        group is rebuilt for the next update."""
        tp = self._run(self._tp_sizes(live, failures))
        path = "/update_weights_from_distributed"

        def fail_all(error: SGLangError) -> None:
            if self._group is not None:
                self._drop_group()
            for url in live:
                failures[url] = (
                    error
                    if error.url == url
                    else WeightUpdateError(f"left out of step by a failed broadcast: {error}", url)
                )
            live.clear()

        try:
            if live and (self._group is None or self._group_urls != live):
                self._group = self._init_group(tp, live)
                self._group_urls = list(live)
            self._run(self._begin_session(live, failures))
            if failures and self._group_urls != live:
                raise WeightUpdateError(f"{', '.join(failures)} left the weight-update group")
        except SGLangError as e:
            fail_all(e)
        for bucket in source.buckets(self.cfg.bucket_bytes):
            if not live:
                continue  # the source's collectives still need this rank
            aligned = ws.order_for_alignment(bucket)
            body = ws.distributed_update_body(aligned, self._group_name, str(version))
            flat, _ = ws.flatten_bucket(aligned)
            futures = [
                self._loop.submit(
                    self._client.post(
                        u, path, body, retry=NO_RETRY, timeout_s=self.cfg.weight_update_timeout_s
                    )
                )
                for u in live
            ]
            assert self._group is not None
            work = torch.distributed.broadcast(flat, src=0, group=self._group, async_op=True)
            try:
                self._await_servers(work.is_completed, futures, path, live)
                work.wait()
                for url, f in zip(live, futures, strict=True):
                    if (reason := _failure_reason(f)) is not None:
                        raise WeightUpdateError(f"{url}{path} failed: {reason}", url)
            except SGLangError as e:
                fail_all(e)
        self._end_session(live, failures)

    def _update_disk(
        self, source: WeightSource, version: int, live: list[str], failures: dict
    ) -> None:
        """The weights written once per version (a re-sync of a stale server at the same version
        reads the same directory), then /update_weights_from_disk on every live server."""
        assert self._disk is not None
        if self._disk_latest is not None and self._disk_latest[0] == version:
            for _ in source.buckets(self.cfg.bucket_bytes):
                pass  # the source's collectives still need this rank
            path = self._disk_latest[1]
        else:
            path = self._disk.write(source.buckets(self.cfg.bucket_bytes), version)
            self._disk_latest = (version, path)
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        route = "/update_weights_from_disk"
        answers = self._run(
            self._post_each(route, dict.fromkeys(live, body), self.cfg.weight_update_timeout_s)
        )
        self._drop_failed(route, answers, live, failures)
        if live:
            self._disk.committed(path)

    # ---- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the weight-update group (on the servers too), close the HTTP session, and stop
        launched servers."""
        for job in list(self._jobs):
            job.cancel()  # their requests' connections close: SGLang aborts them
        if not self._loop.loop.is_closed():
            try:
                self._loop.run(self.pool.close())  # no health checks or restarts from here
                if self._group is not None and self._group_urls:
                    self._loop.run(self._destroy_group(self._group_urls, missing_ok=False))
                self._say_memory_left()
                self._loop.run(self._client.close())
            finally:
                self._loop.close()
        if self._group is not None:
            try:
                torch.distributed.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.warning("could not destroy the weight-update group", exc_info=True)
            self._group = None
        for proc in self._servers:
            proc.stop()
        self._servers.clear()

    def _say_memory_left(self) -> None:
        """Memory stays as it is at close (bringing it back could take GPU memory the trainer
        still holds); the record says what is released, and so does a line for the user."""
        launched = {p.url for p in self._servers}
        left = {u: t for u, t in self._memory.left_released().items() if u not in launched}
        if not (self.leader and left):
            return
        where = self._memory.record.path if self._memory.record is not None else None
        self._announce(
            "SGLang servers left with GPU memory released: "
            + "; ".join(f"{u}: {', '.join(t)}" for u, t in left.items())
            + (f" (recorded in {where}: a run resumed in that directory brings it back)"
               if where else "")
            + ". Anything else must restart them, or POST /resume_memory_occupation with exactly "
            "those tags, before using them"
        )  # fmt: skip

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
