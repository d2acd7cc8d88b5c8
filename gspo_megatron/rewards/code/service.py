"""A sandbox service: the code reward over HTTP, for clusters whose trainers should not run
model-written code on their own nodes.

    python -m gspo_megatron.rewards.code.service --host 0.0.0.0 --port 8000 --scoring all
    gspo-train reward=remote reward.kwargs.url=http://sandbox-host:8000/score reward.timeout_s=120

Endpoints (JSON in, JSON out):

    POST /score   {"prompt": str, "response": str, "label": <a code label>}
                  -> {"reward": float, "reason": str, "tests": [{"status", "wall_s"}, ...]}
                  (the remote reward's protocol: gspo_megatron/rewards/remote.py)
    POST /run     {"program": str, "stdin": str, "language": "python",
                   "mode": "script" | "call" | "expression", "fn_name": str | null}
                  -> the run's result: {"status", "stdout", "stderr", "exit_code", "signal",
                     "wall_s", "cpu_s", "left_processes", "layers", "error"}
    GET  /health  -> {"layers": [...], "workers": int}

A label that cannot be read answers HTTP 400 (the client fails the call at once); a sandbox
that cannot run programs answers 503 (the client retries). Every program runs in this
machine's sandbox under the same limits as the local reward; the service holds no state but
the outcome cache.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from aiohttp import web

from gspo_megatron.rewards.base import RewardError
from gspo_megatron.rewards.code.reward import SCORINGS, CodeReward

logger = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 64 << 20  # a problem's tests can be large


def build_app(reward: CodeReward) -> web.Application:
    async def score(request: web.Request) -> web.Response:
        body = await _json_body(request)
        missing = [k for k in ("response", "label") if k not in body]
        if missing:
            raise web.HTTPBadRequest(text=f"missing fields {missing}")
        try:
            outcome = await reward.evaluate(body.get("prompt", ""), body["response"], body["label"])
        except RewardError as exc:
            status = web.HTTPServiceUnavailable if "sandbox:" in str(exc) else web.HTTPBadRequest
            raise status(text=str(exc)) from None
        return web.json_response(outcome.as_dict())

    async def run(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body.get("program"), str):
            raise web.HTTPBadRequest(text="'program' (text) is required")
        spec = {"mode": body.get("mode", "script"), "fn_name": body.get("fn_name")}
        try:
            result = await reward.sandbox.run(
                body["program"], str(body.get("stdin", "")),
                language=body.get("language", reward.language), spec=spec,
            )  # fmt: skip
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        return web.json_response(result.as_dict())

    async def health(request: web.Request) -> web.Response:
        return web.json_response(
            {"layers": reward.sandbox.layers, "workers": reward.sandbox.workers}
        )

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_post("/score", score)
    app.router.add_post("/run", run)
    app.router.add_get("/health", health)
    app.on_cleanup.append(lambda _: reward.aclose())
    return app


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="the body is not JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The code reward as an HTTP service.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--scoring", default="all", choices=SCORINGS)
    parser.add_argument("--extract", default="fenced", choices=("fenced", "raw"))
    parser.add_argument("--test-timeout-s", type=float, default=6.0)
    parser.add_argument("--memory-mb", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    reward = CodeReward(
        scoring=args.scoring,
        extract=args.extract,
        test_timeout_s=args.test_timeout_s,
        memory_mb=args.memory_mb,
        workers=args.workers,
    )
    web.run_app(build_app(reward), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
