"""The process group of `weight_sync=distributed`: the trainer's sender (rank 0) and every TP rank
of the servers it updates, built with /init_weights_update_group on the servers while this
process joins (weight_sync.init_custom_process_group), and destroyed on both sides at close.

A group broken by a failure cannot be destroyed safely (a peer may never answer): it is dropped,
and its replacement gets a new name (group_name.1, .2, ...).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from gspo_megatron.network import free_port
from gspo_megatron.rollout.sglang import weight_sync as ws
from gspo_megatron.rollout.sglang.client import NO_RETRY
from gspo_megatron.rollout.sglang.protocol import SGLangHTTPError, WeightUpdateError
from gspo_megatron.rollout.sglang.updates.session import await_servers, failure_reason

if TYPE_CHECKING:
    from gspo_megatron.event_loop import LoopThread
    from gspo_megatron.rollout.sglang.client import SGLangClient
    from gspo_megatron.rollout.sglang.config import SGLangEngineConfig

logger = logging.getLogger(__name__)


class WeightUpdateGroup:
    """The group (`group`, None before the first update and after a drop) and the servers in
    it (`urls`, in rank order)."""

    def __init__(self, cfg: SGLangEngineConfig, client: SGLangClient, loop: LoopThread) -> None:
        self.cfg = cfg
        self.client = client
        self.loop = loop
        self.group: torch.distributed.ProcessGroup | None = None
        self.urls: list[str] = []
        self.name = cfg.group_name
        self.dropped = 0

    def join(self, tp: dict[str, int], urls: list[str]) -> None:
        """A group with exactly `urls` (of TP sizes `tp`), unless the current one is that."""
        if self.group is None or self.urls != urls:
            self.group = self._init(tp, urls)
            self.urls = list(urls)

    def drop(self) -> None:
        """A failure left the group unusable: the next update builds a new one."""
        self.group, self.urls = None, []
        self.dropped += 1

    def forget(self, url: str) -> None:
        """`url` restarted: its ranks left the group."""
        if url in self.urls:
            self.drop()

    async def leave(self) -> None:
        """Destroy the group on its servers (at close)."""
        if self.group is not None and self.urls:
            await self._destroy(self.urls, missing_ok=False)

    def close(self) -> None:
        """Destroy this process's end of the group (at close, after `leave`)."""
        if self.group is None:
            return
        try:
            torch.distributed.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.warning("could not destroy the weight-update group", exc_info=True)
        self.group = None

    def _init(self, tp: dict[str, int], urls: list[str]) -> torch.distributed.ProcessGroup:
        cfg = self.cfg
        port = cfg.master_port or free_port()
        world = 1 + sum(tp[u] for u in urls)
        if self.dropped:
            self.loop.run(self._destroy(urls, missing_ok=True))  # the broken one, if any
            self.name = f"{cfg.group_name}.{self.dropped}"
        offsets, next_rank = {}, 1
        for url in urls:
            offsets[url] = next_rank
            next_rank += tp[url]
        # A group of this name left by an earlier trainer that died would make the init fail.
        self.loop.run(self._destroy(urls, missing_ok=True))
        path = "/init_weights_update_group"
        futures = [
            self.loop.submit(
                self.client.post(
                    url,
                    path,
                    ws.init_weights_update_group_body(
                        cfg.master_address, port, offsets[url], world, self.name, cfg.group_backend
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
                    group_name=self.name,
                    timeout=timedelta(seconds=cfg.weight_update_timeout_s),
                )
            except Exception as e:  # noqa: BLE001 - reported below
                box["error"] = e

        joiner = threading.Thread(target=join, name="weight-group-join", daemon=True)
        joiner.start()
        await_servers(lambda: not joiner.is_alive(), futures, path, urls)
        if "error" in box:
            raise WeightUpdateError(
                f"joining the weight-update group at {cfg.master_address}:{port} (world "
                f"{world}) failed: {box['error']}"
            ) from box["error"]
        for url, f in zip(urls, futures, strict=True):
            if (reason := failure_reason(f)) is not None:
                raise WeightUpdateError(f"{url}{path} failed: {reason}", url)
        logger.info("weight-update group %s: world %d at port %d", self.name, world, port)
        return box["group"]

    async def _destroy(self, urls: Sequence[str], *, missing_ok: bool) -> None:
        """POST /destroy_weights_update_group on `urls` (sglang answers 400 "does not exist"
        when there is none; ignored with `missing_ok`)."""
        body = {"group_name": self.name}
        answers = await asyncio.gather(
            *(
                self.client.post(u, "/destroy_weights_update_group", body, retry=NO_RETRY,
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
