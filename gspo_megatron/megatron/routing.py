"""Routing Replay for MoE policies, on megatron-core's RouterReplay.

R2: record each token's top-k experts during the old-policy forward and replay them in the
training forward. R3: replay the routes the rollout engine reports (SGLang's
[tokens, layers, top_k]). Routes travel with each sample as int16 [len-1, num_layers, top_k]
in global token order; this module cuts them into what each router sees (CP zigzag chunks, SP
slice, [s, b] token order of padded rows or of one packed row) and reassembles recorded ones.
While replaying, each router also computes its own top-k, so the fraction of tokens whose expert
set changed between the old and the current policy is measured with and without replay.
"""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from gspo_megatron.device import accelerator
from gspo_megatron.megatron.batch import MicroBatch, assemble_cp_rows
from gspo_megatron.spec.sample import TrainSample


class RouteRecorder:
    def __init__(self, model_chunks: Sequence[torch.nn.Module], config) -> None:
        self.topk = config.moe_router_topk
        self.num_layers = config.num_layers
        self.sequence_parallel = config.sequence_parallel
        # vp_stage (None without virtual pipeline) -> [(global layer index, RouterReplay)]
        self.routers: dict[int | None, list] = {}
        for stage, chunk in enumerate(model_chunks):
            key = stage if len(model_chunks) > 1 else None
            found = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter) and module.router_replay is not None:
                    replay = module.router_replay
                    self._instrument(replay)
                    found.append((module.layer_number - 1, replay))
            self.routers[key] = sorted(found, key=lambda item: item[0])
        self.record = False
        self.replay = False
        # [changed, total] tokens since the last step_metrics, kept on the device (no host sync
        # per router call)
        self._counts: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None

    # -- per schedule ------------------------------------------------------------------------

    def begin(self, *, record: bool, replay: bool) -> None:
        """record: keep the routes each forward used; replay: route with mb.routed_experts.

        Without replay, recorded routes are also compared with mb.routed_experts when given.
        """
        self.record = record
        self.replay = replay
        if replay:
            action = RouterReplayAction.REPLAY_FORWARD
        elif record:
            action = RouterReplayAction.RECORD
        else:
            action = None
        for routers in self.routers.values():
            for _, replay_obj in routers:
                replay_obj.clear_indices()
                replay_obj.router_replay_action = action

    def end(self) -> None:
        for routers in self.routers.values():
            for _, replay_obj in routers:
                replay_obj.clear_indices()
                replay_obj.router_replay_action = None
        self.record = self.replay = False

    def before_forward(self, mb: MicroBatch, vp_stage: int | None) -> None:
        # Routes exist for every consumed token but the last of each sequence.
        self._valid = self._router_view(mb.has_label)
        if not self.replay:
            return
        if mb.routed_experts is None:
            raise ValueError("routing replay is on but the micro-batch carries no routes")
        for layer, replay_obj in self.routers.get(vp_stage, []):
            target = self._router_view(mb.routed_experts[:, :, layer, :].long())
            replay_obj.target_topk_idx = target
            replay_obj.replay_backward_list = [target]

    def after_forward(self, mb: MicroBatch, vp_stage: int | None, sink: list | None) -> None:
        if not self.record or (sink is None and mb.routed_experts is None):
            return
        layers, recorded = [], []
        for layer, replay_obj in self.routers.get(vp_stage, []):
            routes = replay_obj.target_topk_idx if self.replay else replay_obj.recorded_topk_idx
            layers.append(layer)
            recorded.append(self._from_router_view(routes, mb.tokens.shape))
            if mb.routed_experts is not None and not self.replay:
                old = mb.routed_experts[:, :, layer, :]
                self._count_changes(recorded[-1], old, mb.has_label)
        if sink is not None and layers:
            sink.append(
                {
                    "indices": mb.indices,
                    "seq_lengths": mb.seq_lengths,
                    "layers": layers,
                    "routes": mb.rows(torch.stack(recorded, dim=2).to(torch.int16)),
                }
            )

    def step_metrics(self) -> dict[str, float]:
        counts = self._counts
        if counts is None:
            counts = torch.zeros(2, dtype=torch.int64, device=accelerator())
        self._counts = None
        counts = counts.double()
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)
        changed, total = counts.tolist()
        if total == 0:
            return {}
        return {"moe/route_change_fraction": changed / total}

    # -- assembling recorded routes ---------------------------------------------------------

    def collect(self, samples: Sequence[TrainSample], outputs: list[dict]) -> list[np.ndarray]:
        """Recorded routes per sample, int16 [len-1, num_layers, top_k], identical on all ranks."""
        cp = parallel_state.get_context_parallel_world_size()
        cp_group = parallel_state.get_context_parallel_group()
        local: dict[int, dict[int, np.ndarray]] = defaultdict(dict)
        for out in outputs:
            routes = out["routes"]  # this CP rank's row layout: [b, s_row, L_local, k] int16
            if cp > 1:
                # Neither NCCL nor gloo carries int16: gathered as int32.
                wide = routes.int().contiguous()
                parts = [torch.empty_like(wide) for _ in range(cp)]
                dist.all_gather(parts, wide, group=cp_group)
                routes = assemble_cp_rows(parts, out["seq_lengths"].tolist()).to(torch.int16)
            routes = routes.cpu().numpy()  # one copy per micro-batch
            for row, index in enumerate(out["indices"]):
                n = samples[index].length - 1
                for j, layer in enumerate(out["layers"]):
                    local[index][layer] = routes[row, :n, j]
        by_sample: dict[int, dict[int, np.ndarray]] = local
        if dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, dict(local))
            by_sample = defaultdict(dict)
            for part in gathered:
                for index, layers in part.items():
                    by_sample[index].update(layers)
        result = []
        for i in range(len(samples)):
            layers = by_sample[i]
            if len(layers) != self.num_layers:
                raise RuntimeError(
                    f"routes of sample {i} cover {len(layers)} of {self.num_layers} layers"
                )
            # np.stack copies: no sample keeps its micro-batch's array alive
            result.append(np.stack([layers[layer] for layer in range(self.num_layers)], axis=1))
        return result

    # -- router token order ----------------------------------------------------------------------

    def _router_view(self, values: torch.Tensor) -> torch.Tensor:
        """[b, s_cp, ...] -> the router's flattened [s_local * b, ...] (SP slice, s-major)."""
        values = values.transpose(0, 1)
        if self.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            length = values.shape[0] // tp
            values = values[rank * length : (rank + 1) * length]
        return values.reshape((-1,) + tuple(values.shape[2:])).contiguous()

    def _from_router_view(self, routes: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The router's [s_local * b, k] -> [b, s_cp, k], gathering SP slices over TP."""
        b, s_cp = shape
        if self.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            parts = [torch.empty_like(routes) for _ in range(tp)]
            dist.all_gather(
                parts, routes.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
            )
            routes = torch.cat(parts, dim=0)
        return routes.reshape(s_cp, b, -1).transpose(0, 1)

    def _count_changes(self, new: torch.Tensor, old: torch.Tensor, valid: torch.Tensor) -> None:
        same = torch.sort(new, dim=-1).values == torch.sort(old.to(new.dtype), dim=-1).values
        changed = ~same.all(dim=-1) & valid
        counts = torch.stack([changed.sum(), valid.sum()])
        self._counts = counts if self._counts is None else self._counts + counts

    def _instrument(self, replay_obj) -> None:
        """While replaying, also compute the router's own top-k to count route changes."""
        recorder = self
        original = replay_obj.get_replay_topk

        def get_replay_topk(
            obj, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
        ):
            if obj.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                _, natural = default_compute_topk(
                    scores, topk, num_groups=num_groups, group_topk=group_topk
                )
                target = obj.target_topk_idx.to(natural.device)
                valid = (
                    recorder._valid
                    if recorder._valid is not None
                    else torch.ones(natural.shape[0], dtype=torch.bool, device=natural.device)
                )
                recorder._count_changes(natural, target, valid)
            return original(scores, topk, num_groups, group_topk, default_compute_topk)

        replay_obj.get_replay_topk = types.MethodType(get_replay_topk, replay_obj)
