"""A reward computed by an HTTP server.

Each call POSTs `{"prompt": ..., "response": ..., "label": ...}` (JSON) to `url` and expects a
JSON number or an object with the reward under `reward_key` (default "reward"). Connection
errors, request timeouts, HTTP 429 and 5xx are retried with exponential backoff
(`backoff_s * 2**attempt`); other HTTP errors and malformed bodies fail at once. Every error
names the URL. The scorer bounds the whole call (retries included) by its `timeout_s`, so set
that above `max_retries * request_timeout_s` plus the backoffs.

The client is async: the scorer runs it on its event loop with `max_concurrency` requests in
flight and one connection pool for the scorer's lifetime (closed by `RewardScorer.close()`).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp

from gspo_megatron.rewards.base import RewardError

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RemoteRewardError(RewardError):
    """The reward server could not be reached or answered badly."""


class RemoteReward:
    """Async client for a reward server.

    Args:
        url: the endpoint, e.g. "http://reward-host:8000/score".
        request_timeout_s: limit for one HTTP attempt.
        max_retries: extra attempts after the first for retryable failures.
        backoff_s: first retry delay; doubles each retry.
        headers: extra HTTP headers (e.g. {"Authorization": "Bearer ..."}).
        reward_key: where the reward sits in a JSON object answer.
    """

    def __init__(
        self,
        url: str,
        request_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        headers: dict[str, str] | None = None,
        reward_key: str = "reward",
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
        if max_retries < 0:
            raise ValueError(f"remote reward max_retries must be >= 0, got {max_retries}")
        self.url = url
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.headers = dict(headers or {})
        self.reward_key = reward_key
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_session"] = state["_session_loop"] = None
        return state

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
                headers=self.headers,
            )
            self._session_loop = loop
        return self._session

    async def __call__(self, prompt: str, response: str, label: Any) -> float:
        payload = {"prompt": prompt, "response": response, "label": label}
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._get_session().post(self.url, json=payload) as resp:
                    body = await resp.text()
                    if resp.status in _RETRY_STATUS:
                        last_error = f"HTTP {resp.status}: {body[:200]!r}"
                        continue
                    if resp.status != 200:
                        raise RemoteRewardError(
                            f"remote reward {self.url} answered HTTP {resp.status}: {body[:200]!r}"
                        )
                    return self._parse(body)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise RemoteRewardError(
            f"remote reward {self.url} failed after {self.max_retries + 1} attempts: {last_error}"
        )

    def _parse(self, body: str) -> float:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            raise RemoteRewardError(
                f"remote reward {self.url} returned malformed JSON ({exc.msg}): {body[:200]!r}"
            ) from None
        value = data.get(self.reward_key) if isinstance(data, dict) else data
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise RemoteRewardError(
                f"remote reward {self.url} returned {body[:200]!r}; expected a number or "
                f'{{"{self.reward_key}": <number>}}'
            )
        return float(value)

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
