"""What a weight updater is (one subclass per `rollout.sglang.weight_sync` mode) and what every
one is given: the engine's settings, its HTTP client, the event loop the client runs on, and
what each server says of itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gspo_megatron.event_loop import LoopThread
    from gspo_megatron.rollout.base import WeightSource
    from gspo_megatron.rollout.sglang.client import SGLangClient
    from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
    from gspo_megatron.rollout.sglang.protocol import SGLangError
    from gspo_megatron.rollout.sglang.servers import ServerInfos


class WeightUpdater:
    """Moves a weight source's buckets into servers in one mode. Called from the trainer's
    thread on the leader (rank 0, the source's sender); async calls go through `loop`."""

    def __init__(
        self, cfg: SGLangEngineConfig, client: SGLangClient, loop: LoopThread, infos: ServerInfos
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.loop = loop
        self.infos = infos

    def update(
        self,
        source: WeightSource,
        version: int,
        live: list[str],
        failures: dict[str, SGLangError],
    ) -> None:
        """Load `source` into the `live` servers, tagged `version`. A server that fails moves
        from `live` to `failures` with the reason; one failure of the transfer itself may move
        them all. Every bucket of the source is read even when no server is left: the source's
        collectives need this rank."""
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """`url` restarted: what the updater kept about it is gone."""

    async def leave(self) -> None:
        """At close, on the client's loop: undo what the servers hold for the updater."""

    def close(self) -> None:
        """At close, after the client's loop has stopped: release what this process holds."""
