"""Each SGLang server's state, the health checks that move it, and restarts of launched servers
(docs/SGLANG.md, "Failures").

A server is `healthy` (answers /health and holds the current weights: it gets generation),
`suspect` (a request or a health check failed: no new work until it answers again), `restarting`
(its process was restarted here and has not answered yet) or `stale` (it answers but holds older
or partly updated weights: no generation until a full weight update reaches it). Every move is
one log line with the URL and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from gspo_megatron.rollout.base import RolloutUnavailableError
from gspo_megatron.rollout.sglang.client import SGLangClient
from gspo_megatron.rollout.sglang.launcher import SGLangServerProcess
from gspo_megatron.rollout.sglang.protocol import (
    SGLangConnectionError,
    SGLangError,
    SGLangProtocolError,
    SGLangTimeoutError,
)

logger = logging.getLogger(__name__)


class ServerState(enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    RESTARTING = "restarting"
    STALE = "stale"


class ServersUnavailableError(SGLangError, RolloutUnavailableError):
    """No server could serve for rollout.sglang.recovery_timeout_s."""


@dataclass
class Server:
    url: str
    process: SGLangServerProcess | None = None  # launched here (restartable) or attached
    state: ServerState = ServerState.HEALTHY
    reason: str = ""
    since: float = field(default_factory=time.monotonic)  # when it entered `state`
    restarts: int = 0
    gave_up: bool = False  # restarted max_restarts times: left out of service
    resync_failures: int = 0  # consecutive failed weight updates
    last_resync: float = 0.0


@dataclass(frozen=True)
class HealthSettings:
    check_interval_s: float  # how often every server's /health is asked
    restart_after_s: float  # a launched server that answers no /health this long is restarted
    startup_timeout_s: float  # ... or, once restarted, that does not answer within this
    max_restarts: int  # per launched server over the run; then it stays out of service
    recovery_timeout_s: float  # generation waits this long for any server to serve


class ServerPool:
    """The servers' states. `probe(url, timeout_s)` tells whether a server answers (without
    running the model of one whose memory is released), `unusable(url)` why a server that
    answers must still get nothing (its memory state is unknown) or None, `weights_current(url)`
    whether a server that answers again holds the engine's current weights (asked of the
    server), `on_restart(url)` lets the engine forget what it knew about a server. `announce`
    prints a line for the user: a wait for a server to serve says so at once and every
    `status_interval_s`."""

    COUNTERS = (
        "server_restarts",
        "server_failures",
        "requests_resubmitted",
        "stale_answers",
        "weight_update_failures",
    )

    def __init__(
        self,
        servers: Sequence[Server],
        client: SGLangClient,
        settings: HealthSettings,
        *,
        probe: Callable[[str, float], Awaitable[bool]],
        unusable: Callable[[str], str | None],
        weights_current: Callable[[str], Awaitable[bool]],
        on_restart: Callable[[str], None],
        announce: Callable[[str], None],
        status_interval_s: float = 60.0,
    ) -> None:
        self.servers = {s.url: s for s in servers}
        self.client = client
        self.settings = settings
        self._probe = probe
        self._unusable = unusable
        self._weights_current = weights_current
        self._on_restart = on_restart
        self._announce = announce
        self._status_interval_s = status_interval_s
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self._changed: asyncio.Event | None = None
        self._monitor: asyncio.Task | None = None
        self._checking: dict[str, asyncio.Task] = {}
        self._restarting: set[str] = set()
        self._waiting: _Wait | None = None  # no server can generate: since when, the status task

    # ---- states ------------------------------------------------------------------------------

    def serving(self) -> list[str]:
        return [u for u, s in self.servers.items() if s.state is ServerState.HEALTHY]

    def in_state(self, *states: ServerState) -> list[str]:
        return [u for u, s in self.servers.items() if s.state in states]

    def describe(self) -> str:
        return "; ".join(
            f"{u}: {s.state.value}" + (f" ({s.reason})" if s.reason else "")
            for u, s in self.servers.items()
        )

    def set(self, url: str, state: ServerState, reason: str = "") -> None:
        server = self.servers[url]
        if server.state is not state:
            log = logger.info if state is ServerState.HEALTHY else logger.warning
            log("SGLang server %s: %s -> %s%s", url, server.state.value, state.value,
                f" ({reason})" if reason else "")  # fmt: skip
            server.state, server.since = state, time.monotonic()
        server.reason = "" if state is ServerState.HEALTHY else reason
        if self._changed is not None:
            self._changed.set()

    def failed(self, url: str, reason: str) -> None:
        """A request to `url` failed: no new work for it until a health check says otherwise
        (started at once)."""
        if url not in self.servers:
            return
        self.counters["server_failures"] += 1
        if self.servers[url].state in (ServerState.HEALTHY, ServerState.STALE):
            self.set(url, ServerState.SUSPECT, reason)
        else:
            self.servers[url].reason = reason  # the latest failure says most
        self._check_soon(url)

    # ---- waiting for a server ----------------------------------------------------------------

    async def acquire(self) -> str:
        """The least-loaded healthy server; waits for one (starting health checks of the others)
        for at most recovery_timeout_s, then raises RolloutUnavailableError naming them all."""
        self._start()
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.recovery_timeout_s
        while not (urls := self.serving()):
            for url in self.in_state(ServerState.SUSPECT, ServerState.RESTARTING):
                self._check_soon(url)
            left = deadline - loop.time()
            if left <= 0:
                self._stop_waiting()
                raise ServersUnavailableError(
                    f"no SGLang server could generate for {self.settings.recovery_timeout_s:g} s "
                    f"(rollout.sglang.recovery_timeout_s): {self.describe()}",
                    next(iter(self.servers)),
                )
            self._start_waiting(left)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait(), timeout=min(left, self.settings.check_interval_s)
                )
        if self._waiting is not None:
            waited = duration_text(time.monotonic() - self._waiting.since)
            self._stop_waiting()
            self._announce(f"SGLang server {', '.join(urls)} can generate again after {waited}")
        return self.client.pick(urls)

    def _start_waiting(self, left_s: float) -> None:
        """Say at once that generation waits, for what and until when; then every
        status_interval_s how it stands."""
        if self._waiting is not None:
            return
        key = f"rollout.sglang.recovery_timeout_s={self.settings.recovery_timeout_s:g}"
        until = wall_clock(time.time() + left_s)
        self._announce(
            f"no SGLang server can generate: {self.describe()}; waiting for one until {until} "
            f"({key}), checking every {self.settings.check_interval_s:g} s"
        )
        since = time.monotonic()

        async def status() -> None:
            while True:
                await asyncio.sleep(self._status_interval_s)
                self._announce(
                    f"still no SGLang server can generate after "
                    f"{duration_text(time.monotonic() - since)} (until {until}, {key}): "
                    f"{self.describe()}"
                )

        self._waiting = _Wait(since, asyncio.ensure_future(status()))

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.status.cancel()
            self._waiting = None

    # ---- health checks and restarts ----------------------------------------------------------

    def _start(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_interval_s)
            for url in self.servers:
                self._check_soon(url)

    def _check_soon(self, url: str) -> None:
        task = self._checking.get(url)
        if task is None or task.done():
            self._checking[url] = asyncio.ensure_future(self.check(url))

    async def check(self, url: str) -> None:
        """One health check of `url`, and the move it implies."""
        server = self.servers[url]
        timeout = max(0.5, min(5.0, self.settings.check_interval_s))
        exited = server.process is not None and server.process.exit_reason() is not None
        healthy = not exited and await self._probe(url, timeout)
        state = server.state
        if healthy and (why_not := self._unusable(url)) is not None:
            if state is not ServerState.SUSPECT:
                self.counters["server_failures"] += 1
            self.set(url, ServerState.SUSPECT, why_not)
            if server.process is not None:
                await self.restart(url, why_not)
            return
        if healthy:
            if state is ServerState.RESTARTING:
                self.set(url, ServerState.STALE, "restarted with its launch weights")
            elif state is ServerState.SUSPECT:
                try:
                    current = await self._weights_current(url)
                    why_stale = "answers again, holding other weights"
                except SGLangError as e:
                    current, why_stale = False, f"answers again; its weights are unknown: {e}"
                if current:
                    self.set(url, ServerState.HEALTHY, "answers again")
                else:
                    self.set(url, ServerState.STALE, why_stale)
            return
        why = server.process.exit_reason() if exited and server.process else "no /health answer"
        if state in (ServerState.HEALTHY, ServerState.STALE):
            self.counters["server_failures"] += 1
            self.set(url, ServerState.SUSPECT, why or "no /health answer")
        down_for = time.monotonic() - server.since
        patience = (
            self.settings.startup_timeout_s
            if state is ServerState.RESTARTING
            else self.settings.restart_after_s
        )
        if server.process is not None and (exited or down_for >= patience):
            await self.restart(url, why or "no /health answer")

    async def restart(self, url: str, reason: str) -> None:
        server = self.servers[url]
        assert server.process is not None
        if url in self._restarting:
            return  # a health check and a failed re-sync may both ask
        if server.restarts >= self.settings.max_restarts:
            if not server.gave_up:
                server.gave_up = True
                logger.error("SGLang server %s: not restarted again (%d restarts: "
                             "rollout.sglang.max_restarts); last failure: %s",
                             url, server.restarts, reason)  # fmt: skip
                server.reason = f"{reason}; not restarted again after {server.restarts}"
            return
        server.restarts += 1
        server.resync_failures = 0
        self.counters["server_restarts"] += 1
        logger.warning("SGLang server %s: restarting (%s), restart %d", url, reason,
                       server.restarts)  # fmt: skip
        self._on_restart(url)
        loop = asyncio.get_running_loop()
        self._restarting.add(url)
        try:
            await loop.run_in_executor(None, server.process.stop)
            await loop.run_in_executor(None, server.process.start)
        finally:
            self._restarting.discard(url)
        self.set(url, ServerState.RESTARTING, reason)

    async def close(self) -> None:
        self._stop_waiting()
        tasks = [t for t in (self._monitor, *self._checking.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._monitor = None
        self._checking.clear()

    # ---- weight updates ----------------------------------------------------------------------

    async def updated(
        self, targets: Sequence[str], failures: dict[str, SGLangError], version: int
    ) -> None:
        """After a weight update to `version` of `targets`: those that took it are healthy; one
        that failed is suspect when unreachable or its memory state is unknown, else stale (it
        answers but may hold partial weights) until a full update reaches it. On the pool's
        event loop, as every move."""
        now = time.monotonic()
        for url in targets:
            server = self.servers[url]
            server.last_resync = now
            if url not in failures:
                server.resync_failures = 0
                self.set(url, ServerState.HEALTHY, f"holds version {version}")
                continue
            error = failures[url]
            server.resync_failures += 1
            self.counters["weight_update_failures"] += 1
            reason = f"weight update to version {version} failed: {error}"
            unreachable = isinstance(error, (SGLangConnectionError, SGLangTimeoutError))
            if unreachable or self._unusable(url):
                self.failed(url, reason)
            else:
                self.set(url, ServerState.STALE, reason)

    async def due_for_resync(self) -> list[str]:
        """Stale servers that answer and are due for a full weight update (a failed one is
        retried every check_interval_s). A launched server whose updates failed twice running
        is restarted instead."""
        now, out = time.monotonic(), []
        for url in self.in_state(ServerState.STALE):
            server = self.servers[url]
            if server.process is not None and server.resync_failures >= 2:
                await self.restart(url, "its weight updates keep failing")
            elif not server.resync_failures or (
                now - server.last_resync >= self.settings.check_interval_s
            ):
                out.append(url)
        return out

    def take_counters(self) -> dict[str, int]:
        """The counts since the last call."""
        out, self.counters = self.counters, dict.fromkeys(self.COUNTERS, 0)
        return out


class ServerInfos:
    """What each server says of itself (GET /server_info: tp_size, dp_size, pp_size, version,
    startup_time), asked once per server process: forgotten when it restarts."""

    def __init__(self, client: SGLangClient) -> None:
        self.client = client
        self._infos: dict[str, dict] = {}

    def known(self, url: str) -> bool:
        return url in self._infos

    def put(self, url: str, info: dict) -> None:
        self._infos[url] = info

    def forget(self, url: str) -> None:
        self._infos.pop(url, None)

    async def get(self, url: str) -> dict:
        """The cached answer, or GET /server_info (with the client's retries)."""
        if url not in self._infos:
            info = await self.client.get(url, "/server_info")
            if not isinstance(info, dict):
                raise SGLangProtocolError(f"{url}/server_info is not a JSON object", url)
            self._infos[url] = info
        return self._infos[url]


@dataclass
class _Wait:
    since: float  # time.monotonic()
    status: asyncio.Future  # the task that says how the wait stands


def wall_clock(epoch_s: float) -> str:
    """A wall-clock time for the user: 14:03:27 (the date too when it is not today)."""
    stamp = time.localtime(epoch_s)
    today = time.localtime()
    same_day = stamp[:3] == today[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", stamp)


def duration_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
