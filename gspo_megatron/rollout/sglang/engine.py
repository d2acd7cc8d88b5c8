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
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from gspo_megatron.event_loop import LoopThread
from gspo_megatron.network import free_port
from gspo_megatron.rollout.engine import RolloutSample, SamplingParams, WeightSource
from gspo_megatron.rollout.sglang import weight_sync as ws
from gspo_megatron.rollout.sglang.client import NO_RETRY, RetryPolicy, SGLangClient, normalize_url
from gspo_megatron.rollout.sglang.launcher import (
    ServerLaunchConfig,
    SGLangServerProcess,
    wait_until_healthy,
)
from gspo_megatron.rollout.sglang.protocol import (
    SGLangError,
    SGLangHTTPError,
    SGLangProtocolError,
    SGLangTimeoutError,
    WeightUpdateError,
    generate_body,
    parse_generate_response,
    sample_seeds,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

WEIGHT_SYNC_MODES = ("tensor", "distributed", "disk")
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass
class SGLangEngineConfig:
    """Everything the SGLang engine needs (Hydra-friendly: plain types, lists, no Literals)."""

    # Servers. `urls`: running SGLang servers to attach to (also the targets of weight sync and
    # control calls); `launch`: servers to start here (their URLs are added to `urls`);
    # `router_url`: an sglang-router in front of the servers, used for /generate only.
    urls: list[str] = field(default_factory=list)
    launch: list[ServerLaunchConfig] = field(default_factory=list)
    router_url: str | None = None
    api_key: str | None = None
    health_timeout_s: float = 900.0  # launch/attach: wait this long for GET /health == 200
    log_dir: str = "sglang_logs"  # launched servers' stdout/stderr

    # Generation.
    samples_per_request: int = 32  # batch entries per /generate request
    max_concurrency: int = 64  # requests in flight over all servers
    request_timeout_s: float = 1800.0  # one /generate request, however long its samples
    # A server that answers no /health for this long while generating is hung or gone: its
    # requests fail at once, naming it, instead of after request_timeout_s (0: no check).
    liveness_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    max_retries: int = 3  # on connection errors and 5xx, with exponential backoff
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    seed: int | None = None  # seeds the per-call seed base when SamplingParams.seed is None
    return_routed_experts: bool = False  # needs --enable-return-routed-experts on the servers
    routed_experts_layers: int | None = None  # the model's num_hidden_layers
    routed_experts_top_k: int | None = None  # the model's num_experts_per_tok
    pause_mode: str = "abort"  # /pause_generation mode: abort | retract | in_place

    # Weight sync: tensor (colocated) | distributed (disaggregated) | disk.
    weight_sync: str = "disk"
    bucket_bytes: int = 512 * 1024 * 1024
    weight_update_timeout_s: float = 1800.0
    # Colocated: free the servers' GPU memory after each generate() (needs enable_memory_saver);
    # weights come back for the next update, KV cache and CUDA graphs for the next generate().
    offload_after_generate: bool = False
    # distributed mode: the trainer's sender is rank 0 of a group at master_address:master_port
    # (0 = pick a free port); the servers must reach that address.
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_backend: str = "nccl"
    group_name: str = "gspo_weight_update"
    # disk mode: where the sender writes HF safetensors (a filesystem the servers can read) and
    # the model directory whose config/tokenizer files are copied next to them.
    disk_dir: str | None = None
    disk_base_model_path: str | None = None

    def __post_init__(self) -> None:
        def bad(key: str, msg: str) -> ValueError:
            return ValueError(f"rollout.sglang.{key}: {msg}")

        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise bad(
                "weight_sync", f"must be one of {WEIGHT_SYNC_MODES}, got {self.weight_sync!r}"
            )
        if self.pause_mode not in PAUSE_MODES:
            raise bad("pause_mode", f"must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if not self.urls and not self.launch:
            raise bad("urls", "give server URLs to attach to, or servers to launch")
        for key in ("samples_per_request", "max_concurrency", "bucket_bytes"):
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.liveness_timeout_s < 0:
            raise bad("liveness_timeout_s", f"must be >= 0, got {self.liveness_timeout_s}")
        if self.weight_sync == "disk" and not self.disk_dir:
            raise bad("disk_dir", "weight_sync=disk needs a directory the servers can read")
        if self.offload_after_generate:
            for i, lc in enumerate(self.launch):
                if not lc.enable_memory_saver:
                    raise bad(
                        f"launch[{i}].enable_memory_saver",
                        "must be true when offload_after_generate is set",
                    )
        if self.weight_sync in ("tensor", "distributed"):
            for i, lc in enumerate(self.launch):
                if lc.dp_size != 1:
                    raise bad(
                        f"launch[{i}].dp_size",
                        f"SGLang refuses {self.weight_sync} weight updates when dp_size > 1; "
                        "launch one server per replica (several launch entries) with dp_size=1",
                    )
        if self.return_routed_experts:
            for i, lc in enumerate(self.launch):
                if not lc.enable_return_routed_experts:
                    raise bad(
                        f"launch[{i}].enable_return_routed_experts",
                        "must be true when return_routed_experts is set",
                    )


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


def _failure_reason(f: concurrent.futures.Future) -> str | None:
    """None when a finished weight-update request succeeded, else the reason."""
    if f.cancelled():
        return "cancelled"
    if (e := f.exception()) is not None:
        return str(e)
    ans = f.result()
    if isinstance(ans, dict) and ans.get("success") is True:
        return None
    return str(ans.get("message") if isinstance(ans, dict) else ans)


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

    Every trainer rank may hold one; only ranks whose WeightSource `is_sender()` talk to the
    servers during weight sync (the others just drive the source's collectives).
    """

    def __init__(self, cfg: SGLangEngineConfig) -> None:
        self.cfg = cfg
        self.version = 0
        # Servers whose last weight update failed part-way: they may hold a mix of versions and
        # generate nothing until a full update succeeds (SGLang warns that a failed update can
        # leave partial weights).
        self.stale: set[str] = set()
        self._routed_shape = self._resolve_routed_shape()
        # Workers (weight sync, control calls) and where /generate goes.
        self.urls = [normalize_url(u) for u in cfg.urls] + [lc.url for lc in cfg.launch]
        self._router = normalize_url(cfg.router_url) if cfg.router_url else None
        self._gen_urls = [self._router] if self._router else self.urls
        self._seed_rng = random.Random(cfg.seed)
        self._released: set[str] = set()
        # Attached servers' released memory tags as found (a run before this one may have left
        # them released), learned at first use; close() puts them back so.
        self._attached = [normalize_url(u) for u in cfg.urls]
        self._found_released: dict[str, set[str]] | None = None
        self._server_info: dict[str, dict] = {}
        self._group: torch.distributed.ProcessGroup | None = None
        self._disk = (
            ws.DiskWriter(cfg.disk_dir, cfg.disk_base_model_path)
            if cfg.weight_sync == "disk" and cfg.disk_dir
            else None
        )
        self._servers: list[SGLangServerProcess] = []
        self._loop = LoopThread("sglang-client")
        self._client = SGLangClient(
            api_key=cfg.api_key,
            request_timeout_s=cfg.request_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            max_concurrency=cfg.max_concurrency,
            retry=RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.backoff_max_s),
        )
        try:
            self._start_servers()
        except BaseException:
            self.close()
            raise

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
        cfg = self.cfg
        log_dir = Path(cfg.log_dir)
        for i, lc in enumerate(cfg.launch):
            proc = SGLangServerProcess(lc, log_dir / f"sglang_{i}_{lc.port}.log")
            self._servers.append(proc)
            proc.start()
        for proc in self._servers:
            proc.wait_healthy(cfg.health_timeout_s)
        attached = self.urls[: len(cfg.urls)] + ([self._router] if self._router else [])
        for url in attached:
            wait_until_healthy(
                url,
                timeout_s=cfg.health_timeout_s,
                api_key=cfg.api_key,
                poll_s=min(2.0, max(cfg.health_timeout_s / 10, 0.05)),
                what=" (attached server: is it running, and is the URL right?)",
            )

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        """`n` samples for each prompt, grouped per prompt in prompt order."""
        return self._run(self._agenerate(prompts, n, params))

    async def _agenerate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        if n < 1:
            raise ValueError(f"samples per prompt must be >= 1, got {n}")
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; SGLang rejects empty input_ids")
        if self.stale:
            raise SGLangError(
                f"{', '.join(sorted(self.stale))} may hold partly updated weights (a weight "
                "update failed): a full weight update must succeed before they generate",
                sorted(self.stale)[0],
            )
        await self._ensure_resident(MEMORY_TAGS)
        flat_prompts = [list(p) for p in prompts for _ in range(n)]
        base = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        seeds = sample_seeds(base, len(flat_prompts))
        step = self.cfg.samples_per_request
        chunks = [
            range(s, min(s + step, len(flat_prompts))) for s in range(0, len(flat_prompts), step)
        ]
        results = await _gather_or_cancel(
            [
                self._generate_chunk([flat_prompts[k] for k in c], [seeds[k] for k in c], params)
                for c in chunks
            ]
        )
        samples = [s for chunk in results for s in chunk]
        if self.cfg.offload_after_generate:
            await self._release(MEMORY_TAGS)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    async def _generate_chunk(
        self, prompts: list[list[int]], seeds: list[int], params: SamplingParams
    ) -> list[RolloutSample]:
        body = generate_body(
            prompts, seeds, params, return_routed_experts=self._routed_shape is not None
        )
        url = self._client.pick(self._gen_urls)
        answer = await self._while_alive(url, self._client.post(url, "/generate", body))
        outs = parse_generate_response(
            answer,
            [len(p) for p in prompts],
            url + "/generate",
            routed_experts_shape=self._routed_shape,
        )
        samples = []
        for prompt, out in zip(prompts, outs, strict=True):
            version = self.version
            if out.weight_version is not None and out.weight_version.lstrip("-").isdigit():
                version = int(out.weight_version)
            samples.append(
                RolloutSample(
                    prompt_ids=list(prompt),
                    response_ids=out.output_ids,
                    logprobs=out.logprobs,
                    finish_reason=out.finish_reason,
                    weight_version=version,
                    routed_experts=out.routed_experts,
                )
            )
        return samples

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
                if await self._client.is_healthy(url, timeout_s=interval):
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

    async def _post_all(
        self,
        path: str,
        body: dict | None = None,
        *,
        urls: Sequence[str] | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float | None = None,
        expect_json: bool = True,
    ) -> list[Any]:
        targets = list(self.urls if urls is None else urls)
        return await _gather_or_cancel(
            [
                self._client.post(
                    u, path, body, retry=retry, timeout_s=timeout_s, expect_json=expect_json
                )
                for u in targets
            ]
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
        async def check() -> bool:
            urls = list(self.urls) + ([self._router] if self._router else [])
            oks = await asyncio.gather(*(self._client.is_healthy(u) for u in urls))
            return all(oks)

        return self._run(check())

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the servers' GPU memory for `tags` (colocated training; needs
        --enable-memory-saver). Released tags come back automatically when needed."""
        self._run(self._release(tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._run(self._ensure_resident(tags))

    async def _release(self, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t not in self._released]
        if todo:
            await self._post_all("/release_memory_occupation", {"tags": todo})
            self._released.update(todo)

    async def _adopt_memory_state(self) -> None:
        """Bring back what a previous run left released on attached servers (a weight update
        would write into released memory), noting it for close(). SGLang has no query for it:
        resuming a tag that is resident is refused, so each tag is resumed on its own."""
        if self._found_released is not None:
            return

        async def resume(url: str, tag: str) -> bool:
            try:
                await self._client.post(
                    url, "/resume_memory_occupation", {"tags": [tag]}, retry=NO_RETRY,
                    expect_json=False, timeout_s=self.cfg.liveness_timeout_s or None,
                )  # fmt: skip
            except SGLangHTTPError as e:
                if e.status == 400:
                    return False  # resident
                raise
            return True

        found: dict[str, set[str]] = {}
        for url in self._attached:
            resumed = await asyncio.gather(*(resume(url, tag) for tag in MEMORY_TAGS))
            found[url] = {tag for tag, was in zip(MEMORY_TAGS, resumed, strict=True) if was}
            if found[url]:
                logger.info("%s: memory %s was released; resumed it", url, sorted(found[url]))
        self._found_released = found

    async def _restore_memory_state(self) -> None:
        """Leave attached servers' memory as found: released tags released, resident ones
        resident."""
        for url, found in (self._found_released or {}).items():
            for path, tags in (
                ("/release_memory_occupation", found - self._released),
                ("/resume_memory_occupation", self._released - found),
            ):
                if tags:
                    await self._client.post(
                        url, path, {"tags": sorted(tags)}, retry=NO_RETRY, expect_json=False
                    )

    async def _ensure_resident(self, tags: Sequence[str]) -> None:
        await self._adopt_memory_state()
        todo = [t for t in MEMORY_TAGS if t in tags and t in self._released]
        if todo:
            await self._post_all("/resume_memory_occupation", {"tags": todo})
            self._released.difference_update(todo)

    # ---- weight sync -------------------------------------------------------------------------

    def update_weights(self, source: WeightSource | None, version: int) -> None:
        """Load the policy from `source` into every server and tag later samples with `version`.

        Raises WeightUpdateError with the server's reason on failure; then the servers may hold
        partly updated weights: they are `stale` and generate nothing until a full update
        succeeds (a weight-update session the failure left open is closed by the next one).
        """
        if source is None:
            raise ValueError("SGLangEngine.update_weights needs a WeightSource (got None)")
        if not source.is_sender():
            for _ in source.buckets(self.cfg.bucket_bytes):
                pass  # the collectives inside the source need every rank
            self.version = version
            return
        if not self.urls:
            raise ValueError(
                "weight sync needs the servers' own URLs (rollout.sglang.urls or launch), not "
                "only the router"
            )
        t0 = time.perf_counter()
        try:
            self._run(self._ensure_resident(("weights",)))
            self.stale = set(self.urls)
            mode = self.cfg.weight_sync
            if mode == "tensor":
                self._update_tensor(source, version)
            elif mode == "distributed":
                self._update_distributed(source, version)
            else:
                self._update_disk(source, version)
        except WeightUpdateError:
            raise
        except SGLangError as e:
            raise WeightUpdateError(
                f"weight update to version {version} ({self.cfg.weight_sync}) failed: {e}. The "
                "servers may hold partly updated weights: they generate nothing until a full "
                "update succeeds.",
                e.url,
            ) from e
        self.stale.clear()
        self.version = version
        logger.info(
            "SGLang weights -> version %d (%s) in %.2f s",
            version,
            self.cfg.weight_sync,
            time.perf_counter() - t0,
        )

    async def _info(self, url: str) -> dict:
        if url not in self._server_info:
            info = await self._client.get(url, "/server_info")
            if not isinstance(info, dict):
                raise SGLangProtocolError(f"{url}/server_info is not a JSON object", url)
            self._server_info[url] = info
        return self._server_info[url]

    async def _tp_sizes(self) -> dict[str, int]:
        infos = await _gather_or_cancel([self._info(u) for u in self.urls])
        sizes = {}
        for url, info in zip(self.urls, infos, strict=True):
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

    async def _session_call(self, path: str) -> None:
        answers = await self._post_all(path, {}, retry=NO_RETRY)
        self._check_success(path, answers)

    async def _begin_session(self) -> None:
        """/begin_weight_update on every server. A session that an earlier failed or killed
        update left open is ended first (SGLang refuses a second begin): the full update that
        follows replaces whatever it had loaded, and the engine serves nothing until then."""
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
            self._check_success("/end_weight_update", [ended], [url])
            return await self._client.post(url, path, {}, retry=NO_RETRY)

        self._check_success(path, await _gather_or_cancel([begin(u) for u in self.urls]))

    def _check_success(
        self, path: str, answers: Sequence[Any], urls: Sequence[str] | None = None
    ) -> None:
        for url, ans in zip(self.urls if urls is None else urls, answers, strict=True):
            if not (isinstance(ans, dict) and ans.get("success") is True):
                reason = ans.get("message") if isinstance(ans, dict) else ans
                raise WeightUpdateError(f"{url}{path} failed: {reason}", url)

    def _update_tensor(self, source: WeightSource, version: int) -> None:
        tp = self._run(self._tp_sizes())
        path = "/update_weights_from_tensor"
        self._run(self._begin_session())
        for bucket in source.buckets(self.cfg.bucket_bytes):
            bodies, keep_alive = {}, []
            for url in self.urls:
                bodies[url], flat = ws.tensor_update_body(bucket, tp[url], str(version))
                keep_alive.append(flat)  # payloads point at this memory until answered

            async def send(bodies: dict = bodies) -> list[Any]:
                return await _gather_or_cancel(
                    [
                        self._client.post(
                            u, path, b, retry=NO_RETRY, timeout_s=self.cfg.weight_update_timeout_s
                        )
                        for u, b in bodies.items()
                    ]
                )

            self._check_success(path, self._run(send()))
            del keep_alive
        self._run(self._session_call("/end_weight_update"))

    def _init_group(self, tp: dict[str, int]) -> torch.distributed.ProcessGroup:
        cfg = self.cfg
        port = cfg.master_port or free_port()
        world = 1 + sum(tp.values())
        offsets, next_rank = {}, 1
        for url in self.urls:
            offsets[url] = next_rank
            next_rank += tp[url]
        # A group of this name left by an earlier trainer that died would make the init fail.
        self._run(self._destroy_group(missing_ok=True))
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
                        cfg.group_name,
                        cfg.group_backend,
                    ),
                    retry=NO_RETRY,
                    timeout_s=cfg.weight_update_timeout_s,
                )
            )
            for url in self.urls
        ]
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = ws.init_custom_process_group(
                    backend=cfg.group_backend,
                    init_method=f"tcp://{cfg.master_address}:{port}",
                    world_size=world,
                    rank=0,
                    group_name=cfg.group_name,
                    timeout=timedelta(seconds=cfg.weight_update_timeout_s),
                )
            except Exception as e:  # noqa: BLE001 - reported below
                box["error"] = e

        joiner = threading.Thread(target=join, name="weight-group-join", daemon=True)
        joiner.start()
        self._await_servers(lambda: not joiner.is_alive(), futures, path)
        if "error" in box:
            raise WeightUpdateError(
                f"joining the weight-update group at {cfg.master_address}:{port} (world "
                f"{world}) failed: {box['error']}"
            ) from box["error"]
        self._check_success(path, [f.result() for f in futures])
        group = box["group"]
        logger.info("weight-update group %s: world %d at port %d", cfg.group_name, world, port)
        return group

    def _await_servers(
        self,
        done: Callable[[], bool],
        futures: Sequence[concurrent.futures.Future],
        path: str,
    ) -> None:
        """Wait for a local transfer (`done()`) while its HTTP requests run. A server that
        refuses never joins the transfer: fail at once with its reason instead of waiting for
        the process-group timeout."""
        while not done():
            for url, f in zip(self.urls, futures, strict=True):
                if f.done():
                    reason = _failure_reason(f)
                    if reason is not None:
                        for g in futures:
                            g.cancel()
                        raise WeightUpdateError(f"{url}{path} failed: {reason}", url)
            time.sleep(0.001)

    async def _destroy_group(self, *, missing_ok: bool) -> None:
        """POST /destroy_weights_update_group on every server (sglang answers 400 "does not
        exist" when there is none; ignored with `missing_ok`)."""
        body = {"group_name": self.cfg.group_name}
        answers = await asyncio.gather(
            *(
                self._client.post(u, "/destroy_weights_update_group", body, retry=NO_RETRY,
                                  timeout_s=60.0)
                for u in self.urls
            ),
            return_exceptions=True,
        )  # fmt: skip
        for url, ans in zip(self.urls, answers, strict=True):
            if isinstance(ans, BaseException):
                gone = isinstance(ans, SGLangHTTPError) and "does not exist" in ans.reason
                if not (missing_ok and gone):
                    logger.warning("destroying the weight-update group on %s: %s", url, ans)

    def _update_distributed(self, source: WeightSource, version: int) -> None:
        tp = self._run(self._tp_sizes())
        if self._group is None:
            self._group = self._init_group(tp)
        path = "/update_weights_from_distributed"
        self._run(self._begin_session())
        for bucket in source.buckets(self.cfg.bucket_bytes):
            aligned = ws.order_for_alignment(bucket)
            body = ws.distributed_update_body(aligned, self.cfg.group_name, str(version))
            flat, _ = ws.flatten_bucket(aligned)
            futures = [
                self._loop.submit(
                    self._client.post(
                        u, path, body, retry=NO_RETRY, timeout_s=self.cfg.weight_update_timeout_s
                    )
                )
                for u in self.urls
            ]
            work = torch.distributed.broadcast(flat, src=0, group=self._group, async_op=True)
            try:
                self._await_servers(work.is_completed, futures, path)
            except WeightUpdateError:
                self._group = None  # out of step with the servers now
                raise
            work.wait()
            self._check_success(path, [f.result() for f in futures])
        self._run(self._session_call("/end_weight_update"))

    def _update_disk(self, source: WeightSource, version: int) -> None:
        assert self._disk is not None
        path = self._disk.write(source.buckets(self.cfg.bucket_bytes), version)
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        answers = self._run(
            self._post_all(
                "/update_weights_from_disk",
                body,
                retry=NO_RETRY,
                timeout_s=self.cfg.weight_update_timeout_s,
            )
        )
        self._check_success("/update_weights_from_disk", answers)
        self._disk.committed(path)

    # ---- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the weight-update group (on the servers too), close the HTTP session, and stop
        launched servers."""
        if not self._loop.loop.is_closed():
            try:
                if self._group is not None and self.urls:
                    self._loop.run(self._destroy_group(missing_ok=False))
                try:
                    self._loop.run(self._restore_memory_state())
                except SGLangError as e:  # the server may be gone: say so, close the rest
                    logger.warning("could not restore the servers' memory state: %s", e)
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

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
