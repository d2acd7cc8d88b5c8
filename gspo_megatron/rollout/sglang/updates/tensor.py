"""`weight_sync=tensor` (servers colocated with the trainer on its GPUs): each bucket flattened,
serialized as CUDA-IPC handles (weight_sync.tensor_update_body: one payload per server TP rank)
and POSTed to /update_weights_from_tensor, inside a weight-update session."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gspo_megatron.rollout.sglang import weight_sync as ws
from gspo_megatron.rollout.sglang.updates.base import WeightUpdater
from gspo_megatron.rollout.sglang.updates.session import (
    begin_session,
    drop_failed,
    end_session,
    tp_sizes,
)

if TYPE_CHECKING:
    from gspo_megatron.rollout.base import WeightSource
    from gspo_megatron.rollout.sglang.protocol import SGLangError


class TensorUpdater(WeightUpdater):
    """Buckets as CUDA-IPC payloads, one request per server and bucket."""

    def update(
        self,
        source: WeightSource,
        version: int,
        live: list[str],
        failures: dict[str, SGLangError],
    ) -> None:
        run = self.loop.run
        tp = run(tp_sizes(self.infos, "tensor", live, failures))
        path = "/update_weights_from_tensor"
        run(begin_session(self.client, live, failures))
        for bucket in source.buckets(self.cfg.bucket_bytes):
            if not live:
                continue  # the source's collectives still need this rank
            bodies, keep_alive = {}, []
            for url in live:
                bodies[url], flat = ws.tensor_update_body(bucket, tp[url], str(version))
                keep_alive.append(flat)  # payloads point at this memory until answered
            answers = run(
                self.client.post_each(path, bodies, timeout_s=self.cfg.weight_update_timeout_s)
            )
            drop_failed(path, answers, live, failures)
            del keep_alive
        run(end_session(self.client, live, failures))
