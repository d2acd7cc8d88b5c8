"""Async HTTP transport to SGLang servers: timeouts, retries with exponential backoff, bounded
concurrency, least-loaded choice among several servers, and errors that name the URL.

Retry policy: connection failures (refused, reset, DNS) and 5xx answers are retried with
exponential backoff on requests that are safe to repeat (generation, health, cache flush, pause,
memory release). Weight-update requests are never retried: a repeated broadcast would desync the
process group, and a failed update must stop the run with the server's reason. Timeouts are not
retried either (a slow server stays slow; the error says which URL and how long).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from gspo_megatron.rollout.sglang.protocol import (
    SGLangConnectionError,
    SGLangHTTPError,
    SGLangTimeoutError,
    decode_json,
    error_reason,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try. `max_retries` extra attempts after the first, waiting
    `backoff_s * 2**k` (capped at `backoff_max_s`) before attempt k+1."""

    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff_s and backoff_max_s must be >= 0")

    def delay(self, attempt: int) -> float:
        return min(self.backoff_s * (2**attempt), self.backoff_max_s)


NO_RETRY = RetryPolicy(max_retries=0)


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


class SGLangClient:
    """One aiohttp session shared by all requests to a set of SGLang servers.

    Create and use it inside one event loop (the engine runs a private loop thread).
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_concurrency: int = 256,
        retry: RetryPolicy | None = None,
    ) -> None:
        if request_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("request_timeout_s and connect_timeout_s must be > 0")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry = retry or RetryPolicy()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_concurrency = max_concurrency
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._in_flight: dict[str, int] = {}
        self._tiebreak = itertools.count()

    async def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: our semaphore bounds concurrency, not the connector's pool.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=self._headers
            )
            self._sem = asyncio.Semaphore(self._max_concurrency)
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def pick(self, urls: Sequence[str]) -> str:
        """The server with the fewest requests in flight (round-robin among equals)."""
        if not urls:
            raise ValueError("no SGLang server URL to send to")
        turn = next(self._tiebreak)
        order = [urls[(turn + i) % len(urls)] for i in range(len(urls))]
        return min(order, key=lambda u: self._in_flight.get(normalize_url(u), 0))

    async def request(
        self,
        method: str,
        url: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        expect_json: bool = True,
    ) -> Any:
        """Send one request, retrying per `retry`; return parsed JSON (or raw bytes when
        `expect_json` is false). Raises SGLangConnectionError / SGLangTimeoutError /
        SGLangHTTPError / SGLangProtocolError, each naming `url + path`."""
        session = await self._ensure_session()
        assert self._sem is not None
        base = normalize_url(url)
        full = base + path
        policy = retry or self.retry
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.request_timeout_s, sock_connect=self.connect_timeout_s
        )
        last_error: Exception | None = None
        maybe_sent = False  # an attempt got a connection: the server may have acted on it
        for attempt in range(policy.max_retries + 1):
            if attempt:
                await asyncio.sleep(policy.delay(attempt - 1))
            async with self._sem:
                self._in_flight[base] = self._in_flight.get(base, 0) + 1
                try:
                    async with session.request(method, full, json=body, timeout=timeout) as resp:
                        raw = await resp.read()
                        status = resp.status
                except TimeoutError as e:
                    raise SGLangTimeoutError(
                        f"{method} {full} timed out after {timeout.total:g} s "
                        "(raise rollout.sglang.request_timeout_s if generations are long, "
                        "rollout.sglang.weight_update_timeout_s for weight updates)",
                        base,
                    ) from e
                except aiohttp.ClientConnectionError as e:
                    last_error = e
                    maybe_sent |= not isinstance(e, aiohttp.ClientConnectorError)
                    logger.warning(
                        "%s %s failed (%s), attempt %d/%d",
                        method,
                        full,
                        e,
                        attempt + 1,
                        policy.max_retries + 1,
                    )
                    continue
                finally:
                    self._in_flight[base] -= 1
            if status >= 500:
                last_error = SGLangHTTPError(
                    f"{method} {full} answered HTTP {status}: {error_reason(raw)}",
                    base,
                    status,
                    error_reason(raw),
                )
                logger.warning("%s, attempt %d/%d", last_error, attempt + 1, policy.max_retries + 1)
                continue
            if status >= 400:
                reason = error_reason(raw)
                raise SGLangHTTPError(
                    f"{method} {full} answered HTTP {status}: {reason}", base, status, reason
                )
            return decode_json(raw, full) if expect_json else raw
        if isinstance(last_error, SGLangHTTPError):
            raise SGLangHTTPError(
                f"{last_error} (gave up after {policy.max_retries + 1} attempts)",
                base,
                last_error.status,
                last_error.reason,
            ) from last_error
        raise SGLangConnectionError(
            f"cannot reach SGLang server at {full}: {last_error} (gave up after "
            f"{policy.max_retries + 1} attempts; is the server running and the URL right?)",
            base,
            request_sent=maybe_sent,
        ) from last_error

    async def get(self, url: str, path: str, **kw: Any) -> Any:
        return await self.request("GET", url, path, **kw)

    async def post(self, url: str, path: str, body: Any = None, **kw: Any) -> Any:
        return await self.request("POST", url, path, {} if body is None else body, **kw)

    async def post_each(
        self, path: str, bodies: dict[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """`path` once on each server of `bodies` with its body (no retries): its answer, or the
        exception it raised."""
        answers = await asyncio.gather(
            *(
                self.post(u, path, b, retry=NO_RETRY, timeout_s=timeout_s)
                for u, b in bodies.items()
            ),
            return_exceptions=True,
        )
        return dict(zip(bodies, answers, strict=True))

    async def is_healthy(self, url: str, timeout_s: float = 5.0) -> bool:
        """GET /health answers 200 within `timeout_s` (no retries; any failure is False). Not
        queued behind generation requests: a liveness check must not wait for them."""
        session = await self._ensure_session()
        try:
            async with session.get(
                normalize_url(url) + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                await resp.read()
                return resp.status == 200
        except Exception:  # noqa: BLE001 - health is a yes/no question
            return False
