"""RemoteReward against a local aiohttp server: answers, retries with backoff, clear errors."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from aiohttp import web

from gspo_megatron.rewards import RemoteReward, RemoteRewardError, RewardScorer


class _Server:
    """A reward server on 127.0.0.1 in its own thread; counts requests per path."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/{name}", self._handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.hits[name] = self.hits.get(name, 0) + 1
        body = await request.json()
        self.bodies.append(body)
        if name == "score":
            return web.json_response({"reward": len(body["response"]) / 10})
        if name == "number":
            return web.Response(text="0.25", content_type="application/json")
        if name == "flaky":  # two failures, then an answer
            if self.hits[name] <= 2:
                return web.Response(status=503, text="warming up")
            return web.json_response({"reward": 1.0})
        if name == "always500":
            return web.Response(status=500, text="internal error")
        if name == "reject":
            return web.Response(status=400, text="bad label")
        if name == "malformed":
            return web.Response(text="{not json", content_type="application/json")
        if name == "wrongtype":
            return web.json_response({"reward": "high"})
        if name == "slow":
            await asyncio.sleep(1.0)
        return web.json_response({"reward": 0.0})

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = _Server()
    yield s
    s.close()


def _call(reward: RemoteReward, response: str = "abcd", label=None) -> float:
    async def go():
        try:
            return await reward("prompt", response, label)
        finally:
            await reward.aclose()

    return asyncio.run(go())


def test_answers_and_payload(server):
    assert _call(RemoteReward(server.url("score")), "abcd", {"gold": 4}) == pytest.approx(0.4)
    assert server.bodies[-1] == {"prompt": "prompt", "response": "abcd", "label": {"gold": 4}}
    assert _call(RemoteReward(server.url("number"))) == 0.25


def test_retries_with_backoff_then_succeeds(server):
    start = time.perf_counter()
    assert _call(RemoteReward(server.url("flaky"), max_retries=3, backoff_s=0.05)) == 1.0
    assert server.hits["flaky"] == 3
    assert time.perf_counter() - start >= 0.05 + 0.1  # backoffs 0.05 and 0.1


def test_errors_name_the_url(server):
    url = server.url("always500")
    with pytest.raises(RemoteRewardError, match=f"{url} failed after 3 attempts: HTTP 500"):
        _call(RemoteReward(url, max_retries=2, backoff_s=0.01))
    assert server.hits["always500"] == 3

    url = server.url("reject")
    with pytest.raises(RemoteRewardError, match=f"{url} answered HTTP 400"):
        _call(RemoteReward(url, max_retries=3, backoff_s=0.01))
    assert server.hits["reject"] == 1  # a client error is not retried

    with pytest.raises(RemoteRewardError, match="malformed JSON"):
        _call(RemoteReward(server.url("malformed")))
    with pytest.raises(RemoteRewardError, match="expected a number"):
        _call(RemoteReward(server.url("wrongtype")))

    url = server.url("slow")
    with pytest.raises(RemoteRewardError, match=f"{url} failed after 2 attempts: .*Timeout"):
        _call(RemoteReward(url, request_timeout_s=0.2, max_retries=1, backoff_s=0.01))


def test_refused_connection_names_the_url():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RemoteRewardError, match=f"{url} failed after 2 attempts"):
        _call(RemoteReward(url, max_retries=1, backoff_s=0.01))


def test_through_the_scorer_failures_are_counted(server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    with RewardScorer(RemoteReward(server.url("score")), timeout_s=5, max_concurrency=4) as sc:
        assert sc.executor == "async"
        batch = sc.score(["p"] * 3, ["a", "ab", "abc"], [None] * 3)
        assert batch.rewards == pytest.approx([0.1, 0.2, 0.3])
        batch = sc.score(["p"] * 2, ["a", "ab"], [None] * 2)  # the session is reused
        assert batch.status == ["ok", "ok"]
    with RewardScorer(RemoteReward(dead, max_retries=0), timeout_s=5) as sc:
        batch = sc.score(["p"] * 2, ["a", "b"], [None] * 2)
        assert batch.status == ["error", "error"] and dead in batch.errors[0]
    with RewardScorer(RemoteReward(server.url("slow")), timeout_s=0.3) as sc:
        batch = sc.score(["p"], ["a"], [None])
        assert batch.status == ["timeout"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="http"):
        RemoteReward("localhost:8000")
    with pytest.raises(ValueError, match="max_retries"):
        RemoteReward("http://x", max_retries=-1)
