"""The first contact with the SGLang servers: wait until each answers and its memory state is read
(docs/SGLANG.md, "Server memory"), saying at once what the wait waits for and how it stands
every while, and never running the model of a server whose memory is released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from gspo_megatron.rollout.sglang.client import NO_RETRY, SGLangClient
from gspo_megatron.rollout.sglang.launcher import SGLangServerProcess
from gspo_megatron.rollout.sglang.memory import MemoryTracker
from gspo_megatron.rollout.sglang.protocol import (
    SGLangError,
    SGLangHTTPError,
    SGLangProtocolError,
)
from gspo_megatron.rollout.sglang.servers import ServerInfos, duration_text, wall_clock


class ServerStartup:
    """Waits for servers (and a router) to answer. A server's memory state comes from its
    /server_info and the memory record (`memory.adopt`); GET /health (a one-token generation in
    SGLang) is asked only of a server whose memory is all resident, and of the router."""

    def __init__(
        self,
        client: SGLangClient,
        infos: ServerInfos,
        memory: MemoryTracker,
        *,
        router: str | None,
        announce: Callable[[str], None],
        status_interval_s: float,
    ) -> None:
        self.client = client
        self.infos = infos
        self.memory = memory
        self.router = router
        self.announce = announce
        self.status_interval_s = status_interval_s

    async def wait(
        self,
        urls: Sequence[str],
        launched: Mapping[str, SGLangServerProcess],
        timeout_s: float,
    ) -> None:
        """Until every server of `urls` and the router answer (at most `timeout_s`:
        rollout.sglang.health_timeout_s). A launched server that exits fails it at once."""
        targets = list(urls) + ([self.router] if self.router else [])
        pending = dict.fromkeys(targets, "no answer yet")
        started = time.monotonic()
        until = wall_clock(time.time() + timeout_s)
        key = f"rollout.sglang.health_timeout_s={timeout_s:g}"
        poll = min(2.0, max(timeout_s / 10, 0.05))
        announced, next_status = False, 0.0

        def kind(url: str) -> str:
            if url == self.router:
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
                why_not = await self.contact(url)
                if why_not is None:
                    del pending[url]
                else:
                    pending[url] = why_not
            if not pending:
                return
            now = time.monotonic()
            if now - started >= timeout_s:
                logs = "".join(f"; {launched[u].context()}" for u in pending if u in launched)
                hint = "" if set(pending) <= set(launched) else (
                    " (attached server: is it running, and is the URL right?)"
                )  # fmt: skip
                raise SGLangError(
                    f"SGLang server {', '.join(pending)} did not answer within "
                    f"{timeout_s:g} s ({key}): {describe()}{hint}{logs}",
                    next(iter(pending)),
                )
            if not announced:
                self.announce(f"waiting for SGLang servers to answer: {describe()}; until "
                              f"{until} ({key})")  # fmt: skip
                announced, next_status = True, now + self.status_interval_s
            elif now >= next_status:
                self.announce(f"still waiting for SGLang servers after "
                              f"{duration_text(now - started)} (until {until}, {key}): "
                              f"{describe()}")  # fmt: skip
                next_status += self.status_interval_s
            await asyncio.sleep(poll)

    async def contact(self, url: str) -> str | None:
        """None once `url` is ready, else what it lacks. GET /health waits for a server's
        warm-up only when everything is resident."""
        if url == self.router:
            return None if await self.client.is_healthy(url) else "no GET /health answer"
        if not self.infos.known(url):
            try:
                info = await self.client.get(url, "/server_info", retry=NO_RETRY, timeout_s=5.0)
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
            await self.memory.adopt(url, info)
            self.infos.put(url, info)
        if not self.memory.resident(url):
            return None  # never GET /health: its model must not run
        if await self.client.is_healthy(url):
            return None
        return "answers GET /server_info, GET /health not 200 yet (warming up)"
