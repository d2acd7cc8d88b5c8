"""`SGLangEngine`: the ServerRolloutEngine backed by SGLang servers (launched here or attached to).

The trainer calls it synchronously; inside, an event loop on a private thread runs the aiohttp
client, so generation fans out as concurrent batched /generate requests while weight sync can
block the caller's thread on a torch.distributed broadcast. The engine ties the parts, each a
module of its own: the servers' states and restarts (servers.py), the first contact
(startup.py), their GPU memory (memory.py), generation (generation.py) and one weight updater
per mode (updates/).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gspo_megatron.event_loop import LoopThread, gather_or_cancel
from gspo_megatron.rollout.base import JobProgress, RolloutSample, SamplingParams, WeightSource
from gspo_megatron.rollout.sglang.client import RetryPolicy, SGLangClient, normalize_url
from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
from gspo_megatron.rollout.sglang.generation import Generation, routed_shape
from gspo_megatron.rollout.sglang.launcher import SGLangServerProcess
from gspo_megatron.rollout.sglang.memory import (
    MEMORY_TAGS,
    MemoryCalls,
    MemoryRecord,
    MemoryTracker,
)
from gspo_megatron.rollout.sglang.protocol import SGLangConnectionError, WeightUpdateError
from gspo_megatron.rollout.sglang.servers import (
    HealthSettings,
    Server,
    ServerInfos,
    ServerPool,
    ServerState,
)
from gspo_megatron.rollout.sglang.startup import ServerStartup
from gspo_megatron.rollout.sglang.updates.adapter import AdapterUpdater, LoRAServing
from gspo_megatron.rollout.sglang.updates.base import WeightUpdater
from gspo_megatron.rollout.sglang.updates.disk import DiskUpdater
from gspo_megatron.rollout.sglang.updates.distributed import DistributedUpdater
from gspo_megatron.rollout.sglang.updates.tensor import TensorUpdater

logger = logging.getLogger(__name__)

T = TypeVar("T")

# rollout.sglang.weight_sync -> its updater
UPDATERS: dict[str, type[WeightUpdater]] = {
    "tensor": TensorUpdater,
    "distributed": DistributedUpdater,
    "disk": DiskUpdater,
}


class SGLangEngine:
    """ServerRolloutEngine over SGLang servers. See docs/SGLANG.md for recipes.

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
        lora: LoRAServing | None = None,
    ) -> None:
        """`partial_rollouts` (rollout.mode=async): a weight update aborts the requests in
        flight and continues them on the new weights; otherwise it waits for them (SGLang holds
        an update until the requests running finish). `memory_record`: the file where the leader
        records which GPU memory of the servers it released (gspo-train: <run
        directory>/sglang_memory.json), for a run resumed in the same directory; None: no record
        (a server the engine has no record of counts as resident). `announce(line)` tells the
        user what a wait for servers waits for, at once and every `status_interval_s` (default:
        a warning in this module's log). `lora` (lora_sync=adapter): what the servers need to
        serve the adapters; launched ones get its flags, attached ones are checked."""
        cfg.validate()
        self._lora = lora
        self.cfg = cfg
        self.leader = leader
        routed = routed_shape(cfg)  # before any thread starts: a ValueError leaves none behind
        self._announce = announce or (lambda line: logger.warning("%s", line))
        # Workers (weight sync, control calls) and the router /generate goes to, if any.
        self.urls = [normalize_url(u) for u in cfg.urls] + [lc.url for lc in cfg.launch]
        self._router = normalize_url(cfg.router_url) if cfg.router_url else None
        self._servers: list[SGLangServerProcess] = []
        self._client = SGLangClient(
            api_key=cfg.api_key,
            request_timeout_s=cfg.request_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            max_concurrency=cfg.max_concurrency,
            retry=RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.backoff_max_s),
        )
        self._infos = ServerInfos(self._client)
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
            weights_current=lambda url: self._generation.holds_current_weights(url),
            on_restart=self._forget,
            announce=self._announce,
            status_interval_s=status_interval_s,
        )
        self._memory_calls = MemoryCalls(self._memory, self.pool.failed)
        self._generation = Generation(
            cfg,
            client=self._client,
            pool=self.pool,
            memory=self._memory_calls,
            infos=self._infos,
            loop=self._loop,
            urls=self.urls,
            router=self._router,
            reachable=self._reachable,
            routed_shape=routed,
            partial_rollouts=partial_rollouts,
        )
        # lora_sync=adapter: the adapters through SGLang's LoRA API, written under disk_dir
        updater = AdapterUpdater if cfg.lora_sync == "adapter" else UPDATERS[cfg.weight_sync]
        self._updater = updater(cfg, self._client, self._loop, self._infos)
        if isinstance(self._updater, AdapterUpdater):
            self._generation.lora_path = lambda: self._updater.current
        if not leader:
            return
        startup = ServerStartup(
            self._client,
            self._infos,
            self._memory,
            router=self._router,
            announce=self._announce,
            status_interval_s=status_interval_s,
        )
        try:
            self._start_servers(startup)
        except BaseException:
            self.close()
            raise
        launched = {p.url: p for p in self._servers}
        self.pool.servers = {u: Server(u, launched.get(u)) for u in self.urls}
        for url in self.urls:
            if (why := self._memory.unknown(url)) is not None:
                self.pool.set(url, ServerState.SUSPECT, why)
                self._announce(f"SGLang server {url}: {why}")

    @property
    def version(self) -> int:
        """The weight version of the latest update (0 before the first)."""
        return self._generation.versions.version

    def _start_servers(self, startup: ServerStartup) -> None:
        for i, lc in enumerate(self.cfg.launch):
            proc = SGLangServerProcess(lc, Path(self.cfg.log_dir) / f"sglang_{i}_{lc.port}.log")
            if self._lora is not None:
                proc.command += self._lora.launch_args()
            self._servers.append(proc)
            proc.start()
        launched = {p.url: p for p in self._servers}
        self._run(startup.wait(self.urls, launched, self.cfg.health_timeout_s))
        if self._lora is not None:
            for url in self.urls:
                info = self._run(self._infos.get(url))
                if (why := self._lora.refusal(url, info)) is not None:
                    raise ValueError(why)

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
        progress: JobProgress | None = None,
    ) -> concurrent.futures.Future[list[list[RolloutSample]]]:
        """`generate` running on the client's loop; the caller may update weights meanwhile
        (stale servers': `servers_to_resync`, `update_weights(..., urls=...)`; every server's,
        rollout.mode one_step_off / async). Its future holds the job's `JobStats` as `job_stats`.

        The job's requests start once the engine's weights are at least `min_version` (default:
        the current version), and an answer from older weights is never used. `urgent` (the
        generator process jumps its queue with it) changes nothing here: every job's requests
        share the servers at once, so none waits behind another. `progress` (a checkpoint's):
        complete samples are kept, partial ones continue from their tokens with their seeds.
        """
        del urgent
        if not self.leader:
            raise RuntimeError("SGLangEngine.generate runs on the leader (rank 0) only")
        return self._generation.start(prompts, n, params, min_version, progress)

    def snapshot(self, jobs: Sequence[concurrent.futures.Future]) -> list[JobProgress]:
        """The samples of `jobs` as the client holds them: complete ones, and each partial one's
        tokens up to its last answer (async: the weight update before a checkpoint aborts the
        requests running and collects their tokens). Tokens of a request still running are
        not in it: a resumed run samples them again. The jobs go on undisturbed."""
        return self._run(self._generation.snapshot(jobs))

    # ---- server faults -----------------------------------------------------------------------

    def _forget(self, url: str) -> None:
        """A restarted server: its cached info, its released memory, and any weight-update group
        with it, are gone."""
        self._infos.forget(url)
        self._memory.forget(url)
        self._updater.forget(url)

    @property
    def resync_poll_s(self) -> float:
        """How often a caller waiting on `start_generate` asks `servers_to_resync`."""
        return min(5.0, self.cfg.health_check_interval_s)

    def servers_to_resync(self) -> list[str]:
        """Stale servers that answer and are due for a full weight update (the caller runs
        `update_weights(source, version, urls=...)` on every rank). A launched server whose
        updates failed twice running is restarted instead."""
        if not self.leader or not self._generation.versions.updated:
            return []
        return self._run(self.pool.due_for_resync())

    def fault_metrics(self) -> dict[str, float]:
        """Counts since the last call (restarts, resubmitted requests, ..., the prefix cache's
        share of the input tokens) and the number of healthy servers, as rollout/* metrics (the
        leader's; empty elsewhere)."""
        if not self.leader:
            return {}

        async def take() -> dict[str, float]:
            out = {f"rollout/{k}": float(v) for k, v in self.pool.take_counters().items()}
            out["rollout/servers_healthy"] = float(len(self.pool.serving()))
            out.update(self._generation.take_cache_metrics())
            return out

        return self._run(take())

    # ---- control -----------------------------------------------------------------------------

    async def _post_all(self, path: str, body: dict, *, expect_json: bool = True) -> list[Any]:
        """`path` on every server that answers (healthy or stale); the first failure raises."""
        return await gather_or_cancel(
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
        if self._generation.busy():
            raise RuntimeError(
                "SGLangEngine.release_memory while a generate job runs: SGLang 0.5.23 asserts the "
                "server is idle and exits when it is not"
            )
        self._run(self._memory_calls.release(self._reachable(), tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Bring back the released ones of `tags` on every server that answers."""
        self._run(self._memory_calls.resume(self._reachable(), tags))

    def _reachable(self) -> list[str]:
        """Servers that answer (healthy or stale): the targets of control calls."""
        if not self.pool.servers:
            return list(self.urls)
        return self.pool.in_state(ServerState.HEALTHY, ServerState.STALE)

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
        versions = self._generation.versions
        if not (self.leader and source.is_sender()):
            for _ in source.buckets(self.cfg.bucket_bytes):
                pass  # the collectives inside the source need every rank
            versions.set(version)
            return
        if not self.urls:
            raise ValueError(
                "weight sync needs the servers' own URLs (rollout.sglang.urls or launch), not "
                "only the router"
            )
        t0 = time.perf_counter()
        targets = list(self._reachable() if urls is None else urls)
        self._run(self._generation.check_pause_mode(targets))
        swap = self._generation.swap_due(every_server=urls is None)
        mode = self.cfg.weight_sync
        paused: list[str] = []
        held: list[str] = []
        try:
            if swap:
                paused = self._run(self._generation.pause_for_swap(targets))
            live = [u for u in targets if u in self._reachable()]
            failures = {
                u: SGLangConnectionError(f"{u} did not answer", u) for u in targets if u not in live
            }
            # Never load into released weights (SGLang would write to unmapped memory), nor
            # release them while loading.
            failures.update(self._run(self._memory_calls.hold(live, ("weights",))))
            live = [u for u in live if u not in failures]
            held = list(live)
            self._updater.update(source, version, live, failures)
            versions.set(version)
            self._run(self.pool.updated(targets, failures, version))
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

    async def _after_update(self, paused: Sequence[str], held: Sequence[str]) -> None:
        """The weights may be released again; paused servers generate again; jobs waiting for
        this version go on."""
        self._memory_calls.unhold(held)
        await self._generation.after_update(paused)

    # ---- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the weight-update group (on the servers too), close the HTTP session, and stop
        launched servers. The servers' memory stays as it is (docs/SGLANG.md, "Server
        memory"): a line says what is left released."""
        self._generation.cancel()
        if not self._loop.loop.is_closed():
            try:
                self._loop.run(self.pool.close())  # no health checks or restarts from here
                self._loop.run(self._updater.leave())
                line = self._memory.left_line(p.url for p in self._servers)
                if self.leader and line:
                    self._announce(line)
                self._loop.run(self._client.close())
            finally:
                self._loop.close()
        self._updater.close()
        for proc in self._servers:
            proc.stop()
        self._servers.clear()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
