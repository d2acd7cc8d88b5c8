"""`weight_sync=disk`: the weights written once per version as HF safetensors under
rollout.sglang.disk_dir (weight_sync.DiskWriter), then /update_weights_from_disk on every live
server. Not inside a weight-update session: SGLang's disk loader restores, loads and
post-processes the weights itself (weight_sync.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gspo_megatron.rollout.sglang import weight_sync as ws
from gspo_megatron.rollout.sglang.updates.base import WeightUpdater
from gspo_megatron.rollout.sglang.updates.session import drop_failed

if TYPE_CHECKING:
    from gspo_megatron.event_loop import LoopThread
    from gspo_megatron.rollout.base import WeightSource
    from gspo_megatron.rollout.sglang.client import SGLangClient
    from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
    from gspo_megatron.rollout.sglang.protocol import SGLangError
    from gspo_megatron.rollout.sglang.servers import ServerInfos


class DiskUpdater(WeightUpdater):
    """A directory per version; a re-sync of a stale server at the same version reads the same
    one. The previous directory goes once a server has loaded the new one."""

    def __init__(
        self, cfg: SGLangEngineConfig, client: SGLangClient, loop: LoopThread, infos: ServerInfos
    ) -> None:
        super().__init__(cfg, client, loop, infos)
        assert cfg.disk_dir, "SGLangEngineConfig.validate: weight_sync=disk needs disk_dir"
        self.writer = ws.DiskWriter(cfg.disk_dir, cfg.disk_base_model_path)
        self._latest: tuple[int, Path] | None = None  # the last version written, and where

    def update(
        self,
        source: WeightSource,
        version: int,
        live: list[str],
        failures: dict[str, SGLangError],
    ) -> None:
        if self._latest is not None and self._latest[0] == version:
            for _ in source.buckets(self.cfg.bucket_bytes):
                pass  # the source's collectives still need this rank
            path = self._latest[1]
        else:
            path = self.writer.write(source.buckets(self.cfg.bucket_bytes), version)
            self._latest = (version, path)
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        route = "/update_weights_from_disk"
        bodies = dict.fromkeys(live, body)
        answers = self.loop.run(
            self.client.post_each(route, bodies, timeout_s=self.cfg.weight_update_timeout_s)
        )
        drop_failed(route, answers, live, failures)
        if live:
            self.writer.committed(path)
