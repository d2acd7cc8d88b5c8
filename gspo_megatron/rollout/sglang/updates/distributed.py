"""`weight_sync=distributed` (servers on GPUs of their own): per bucket, the names, dtypes and
shapes POSTed to /update_weights_from_distributed while the sender broadcasts the bucket as one
flat tensor over the weight-update group (group.py), inside a weight-update session."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gspo_megatron.rollout.sglang import weight_sync as ws
from gspo_megatron.rollout.sglang.client import NO_RETRY
from gspo_megatron.rollout.sglang.protocol import SGLangError, WeightUpdateError
from gspo_megatron.rollout.sglang.updates.base import WeightUpdater
from gspo_megatron.rollout.sglang.updates.group import WeightUpdateGroup
from gspo_megatron.rollout.sglang.updates.session import (
    await_servers,
    begin_session,
    end_session,
    failure_reason,
    tp_sizes,
)

if TYPE_CHECKING:
    from gspo_megatron.event_loop import LoopThread
    from gspo_megatron.rollout.base import WeightSource
    from gspo_megatron.rollout.sglang.client import SGLangClient
    from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
    from gspo_megatron.rollout.sglang.servers import ServerInfos


class DistributedUpdater(WeightUpdater):
    """One broadcast group with the trainer's sender and every live server. The servers of a
    broadcast move together: any failure leaves them all out of step (fenced), and the group is
    rebuilt for the next update."""

    def __init__(
        self, cfg: SGLangEngineConfig, client: SGLangClient, loop: LoopThread, infos: ServerInfos
    ) -> None:
        super().__init__(cfg, client, loop, infos)
        self.group = WeightUpdateGroup(cfg, client, loop)

    def update(
        self,
        source: WeightSource,
        version: int,
        live: list[str],
        failures: dict[str, SGLangError],
    ) -> None:
        tp = self.loop.run(tp_sizes(self.infos, "distributed", live, failures))
        path = "/update_weights_from_distributed"

        def fail_all(error: SGLangError) -> None:
            if self.group.group is not None:
                self.group.drop()
            for url in live:
                failures[url] = (
                    error
                    if error.url == url
                    else WeightUpdateError(f"left out of step by a failed broadcast: {error}", url)
                )
            live.clear()

        try:
            if live:
                self.group.join(tp, live)
            self.loop.run(begin_session(self.client, live, failures))
            if failures and self.group.urls != live:
                raise WeightUpdateError(f"{', '.join(failures)} left the weight-update group")
        except SGLangError as e:
            fail_all(e)
        for bucket in source.buckets(self.cfg.bucket_bytes):
            if not live:
                continue  # the source's collectives still need this rank
            aligned = ws.order_for_alignment(bucket)
            body = ws.distributed_update_body(aligned, self.group.name, str(version))
            flat, _ = ws.flatten_bucket(aligned)
            futures = [
                self.loop.submit(
                    self.client.post(
                        u, path, body, retry=NO_RETRY, timeout_s=self.cfg.weight_update_timeout_s
                    )
                )
                for u in live
            ]
            assert self.group.group is not None
            work = torch.distributed.broadcast(flat, src=0, group=self.group.group, async_op=True)
            try:
                await_servers(work.is_completed, futures, path, live)
                work.wait()
                for url, f in zip(live, futures, strict=True):
                    if (reason := failure_reason(f)) is not None:
                        raise WeightUpdateError(f"{url}{path} failed: {reason}", url)
            except SGLangError as e:
                fail_all(e)
        self.loop.run(end_session(self.client, live, failures))

    def forget(self, url: str) -> None:
        self.group.forget(url)

    async def leave(self) -> None:
        await self.group.leave()

    def close(self) -> None:
        self.group.close()
