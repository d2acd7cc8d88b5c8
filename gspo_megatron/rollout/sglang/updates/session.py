"""What every weight update shares: reading a server's answer (success, or the reason it
refused), moving a failed server from `live` to `failures`, waiting for a local transfer while
its HTTP requests run, the servers' TP sizes, and SGLang 0.5.23's weight-update session
(/begin_weight_update ... /end_weight_update) around tensor and distributed updates."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from gspo_megatron.rollout.sglang.client import NO_RETRY, SGLangClient
from gspo_megatron.rollout.sglang.protocol import SGLangError, SGLangHTTPError, WeightUpdateError
from gspo_megatron.rollout.sglang.servers import ServerInfos

logger = logging.getLogger(__name__)


def refusal(answer: Any) -> str | None:
    """None when a weight-update answer says success, else the server's reason."""
    if isinstance(answer, dict) and answer.get("success") is True:
        return None
    return str(answer.get("message") if isinstance(answer, dict) else answer)


def failure_reason(f: concurrent.futures.Future) -> str | None:
    """None when a finished weight-update request succeeded, else the reason."""
    if f.cancelled():
        return "cancelled"
    if (e := f.exception()) is not None:
        return str(e)
    return refusal(f.result())


def drop_failed(
    path: str, answers: dict[str, Any], live: list[str], failures: dict[str, SGLangError]
) -> None:
    """Move servers whose answer is not a success from `live` to `failures`."""
    for url, ans in answers.items():
        if isinstance(ans, SGLangError):
            failures[url] = ans
        elif isinstance(ans, BaseException):
            raise ans
        elif (reason := refusal(ans)) is not None:
            failures[url] = WeightUpdateError(f"{url}{path} failed: {reason}", url)
        else:
            continue
        live.remove(url)


def await_servers(
    done: Callable[[], bool],
    futures: Sequence[concurrent.futures.Future],
    path: str,
    urls: Sequence[str],
) -> None:
    """Wait for a local transfer (`done()`) while its HTTP requests run. A server that refuses
    never joins the transfer: fail at once with its reason instead of waiting for the
    process-group timeout."""
    while not done():
        for url, f in zip(urls, futures, strict=True):
            if f.done():
                reason = failure_reason(f)
                if reason is not None:
                    for g in futures:
                        g.cancel()
                    raise WeightUpdateError(f"{url}{path} failed: {reason}", url)
        time.sleep(0.001)


async def tp_sizes(
    infos: ServerInfos, mode: str, live: list[str], failures: dict[str, SGLangError]
) -> dict[str, int]:
    """Each live server's TP size (its /server_info); a server that does not answer moves to
    `failures`. A server whose layout `mode` cannot update is a ValueError."""
    answers = await asyncio.gather(*(infos.get(u) for u in live), return_exceptions=True)
    sizes = {}
    for url, info in zip(list(live), answers, strict=True):
        if isinstance(info, SGLangError):
            failures[url] = info
            live.remove(url)
            continue
        if isinstance(info, BaseException):
            raise info
        if int(info.get("dp_size", 1)) != 1:
            raise ValueError(
                f"{url} runs dp_size={info['dp_size']}; SGLang refuses {mode} weight updates "
                "with dp_size > 1: run one server per replica with dp_size=1"
            )
        if int(info.get("pp_size", 1)) != 1:
            raise ValueError(
                f"{url} runs pp_size={info['pp_size']}; {mode} weight sync supports pp_size=1 "
                "servers only (use weight_sync=disk)"
            )
        sizes[url] = int(info.get("tp_size", 1))
    return sizes


def _left_open(reason: str) -> bool:
    return "already open" in reason


async def begin_session(
    client: SGLangClient, live: list[str], failures: dict[str, SGLangError]
) -> None:
    """/begin_weight_update on every live server. A session that an earlier failed or killed
    update left open is ended first (SGLang refuses a second begin): the full update that
    follows replaces whatever it had loaded, and the server serves nothing until then."""
    path = "/begin_weight_update"

    async def begin(url: str) -> Any:
        try:
            answer = await client.post(url, path, {}, retry=NO_RETRY)
            refused = isinstance(answer, dict) and answer.get("success") is not True
            if not (refused and _left_open(str(answer.get("message")))):
                return answer
        except SGLangHTTPError as e:
            if not _left_open(e.reason):
                raise
        logger.warning("%s: closing a weight-update session an earlier update left open", url)
        ended = await client.post(url, "/end_weight_update", {}, retry=NO_RETRY)
        if not (isinstance(ended, dict) and ended.get("success") is True):
            return ended
        return await client.post(url, path, {}, retry=NO_RETRY)

    answers = await asyncio.gather(*(begin(u) for u in live), return_exceptions=True)
    drop_failed(path, dict(zip(list(live), answers, strict=True)), live, failures)


async def end_session(
    client: SGLangClient, live: list[str], failures: dict[str, SGLangError]
) -> None:
    """/end_weight_update on every live server (the weights are post-processed, the cache
    flushed)."""
    path = "/end_weight_update"
    if live:
        drop_failed(path, await client.post_each(path, dict.fromkeys(live, {})), live, failures)
