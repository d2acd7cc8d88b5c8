"""Routing Replay for MoE policies, on megatron-core's RouterReplay.

R2: record each token's top-k experts during the old-policy forward and replay them in the
training forward. R3: replay the routes the rollout engine reports (SGLang's
[tokens, layers, top_k]). Routes travel with each sample as int16 [len-1, num_layers, top_k]
in global token order; this module cuts them into what each router sees (CP zigzag chunks, SP
slice, [s, b] token order of padded rows or of one packed row) and reassembles recorded ones.
Recorded routes are the experts each router used: its own top-k, or under replay the experts it
was given, as it returned them to the dispatcher.

Per layer and optimizer step it counts (on the device; `step_metrics` reduces them over every
rank as metric sums, gspo_megatron.algorithms.metrics): tokens whose router's own top-k differs
from the routes the batch carries (the old policy's, or the rollout's under R3: computed while
replaying too, so the route change is measured with and without replay), and tokens routed with
replayed experts (the replay coverage).
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

from gspo_megatron.algorithms.metrics import finalize_metrics
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
                    self._instrument(replay, module.layer_number - 1)
                    found.append((module.layer_number - 1, replay))
            self.routers[key] = sorted(found, key=lambda item: item[0])
        self.record = False
        self.replay = False
        self.count = False
        # Per layer [changed, compared, replayed, routed] tokens since `begin`, kept on the
        # device (no host sync per router call).
        self._counts: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None

    # -- per schedule ------------------------------------------------------------------------

    def begin(self, *, record: bool, replay: bool, count: bool = True) -> None:
        """record: keep the routes each forward used; replay: route with mb.routed_experts;
        count: count the tokens for `step_metrics`: routed, replayed, and changed against
        mb.routed_experts (recorded routes without replay; the router's own top-k under
        replay). Generation and training steps that log no route metrics leave it off.
        """
        self.record = record
        self.replay = replay
        self.count = count
        self._counts = None
        if replay:
            action = RouterReplayAction.REPLAY_FORWARD
        elif record:
            action = RouterReplayAction.RECORD
        else:
            action = None
        for routers in self.routers.values():
            for _, replay_obj in routers:
                replay_obj.clear_indices()
                replay_obj.used_topk_idx = None
                replay_obj.router_replay_action = action

    def end(self) -> None:
        for routers in self.routers.values():
            for _, replay_obj in routers:
                replay_obj.clear_indices()
                replay_obj.used_topk_idx = None
                replay_obj.router_replay_action = None
        self.record = self.replay = self.count = False

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
            routes = replay_obj.used_topk_idx if self.replay else replay_obj.recorded_topk_idx
            layers.append(layer)
            recorded.append(self._from_router_view(routes, mb.tokens.shape))
            if mb.routed_experts is not None and not self.replay and self.count:
                old = mb.routed_experts[:, :, layer, :]
                self._count(layer, changed=(recorded[-1], old), valid=mb.has_label, routed=False)
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
        """The schedule's route counts over every rank (each layer lives on one pipeline stage;
        the counts' ratios are the same whether or not TP ranks share tokens), as
        moe/route_change_fraction (all layers), moe/route_change/layer_<L> and
        moe/replay_coverage; {} when nothing was routed or compared."""
        counts = self._counts
        if counts is None:
            counts = torch.zeros(self.num_layers, 4, dtype=torch.int64, device=accelerator())
        self._counts = None
        counts = counts.double()
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)
        # read back once; whole numbers below 2**53, so every sum below is exact
        changed, compared, replayed, routed = counts.T.tolist()
        sums = {
            "moe/route_change_fraction/sum": sum(changed),
            "moe/route_change_fraction/count": sum(compared),
        }
        for layer in range(self.num_layers):
            sums[f"moe/route_change/layer_{layer}/sum"] = changed[layer]
            sums[f"moe/route_change/layer_{layer}/count"] = compared[layer]
        if sum(routed) > 0:
            sums["moe/replay_coverage/sum"] = sum(replayed)
            sums["moe/replay_coverage/count"] = sum(routed)
        return finalize_metrics(sums, omit_empty=("moe/",))

    # -- assembling recorded routes ---------------------------------------------------------

    def collect(self, samples: Sequence[TrainSample], outputs: list[dict]) -> list[np.ndarray]:
        """Recorded routes per sample, int16 [len-1, num_layers, top_k], identical on all ranks.

        Each micro-batch's forward of a model chunk recorded its layers for its samples; a
        sample's routes are those chunks side by side in layer order (TP and CP ranks record the
        same chunks: one of each is kept)."""
        cp = parallel_state.get_context_parallel_world_size()
        cp_group = parallel_state.get_context_parallel_group()
        every_layer = tuple(range(self.num_layers))
        if dist.get_world_size() == 1 and all(tuple(o["layers"]) == every_layer for o in outputs):
            return self._collect_whole(samples, outputs)
        # sample -> {the chunk's layers: [len-1, len(layers), k]}
        local: dict[int, dict[tuple[int, ...], np.ndarray]] = defaultdict(dict)
        for out in outputs:
            routes = out["routes"]  # this CP rank's row layout: [b, s_row, L_local, k] int16
            if cp > 1:
                # Neither NCCL nor gloo carries int16: gathered as int32.
                wide = routes.int().contiguous()
                parts = [torch.empty_like(wide) for _ in range(cp)]
                dist.all_gather(parts, wide, group=cp_group)
                routes = assemble_cp_rows(parts, out["seq_lengths"].tolist()).to(torch.int16)
            routes = routes.cpu().numpy()  # one copy per micro-batch
            layers = tuple(out["layers"])
            for row, index in enumerate(out["indices"]):
                local[index][layers] = routes[row, : samples[index].length - 1]
        by_sample: dict[int, dict[tuple[int, ...], np.ndarray]] = local
        if dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, dict(local))
            by_sample = defaultdict(dict)
            for part in gathered:
                for index, chunks in part.items():
                    by_sample[index].update(chunks)
        result = []
        for i in range(len(samples)):
            chunks = sorted(by_sample[i].items())
            layers = tuple(layer for chunk_layers, _ in chunks for layer in chunk_layers)
            if layers != every_layer:
                raise RuntimeError(
                    f"routes of sample {i} cover {len(set(layers))} of {self.num_layers} layers"
                )
            # copies: no sample keeps its micro-batch's array alive
            parts = [part for _, part in chunks]
            result.append(parts[0].copy() if len(parts) == 1 else np.concatenate(parts, axis=1))
        return result

    def _collect_whole(
        self, samples: Sequence[TrainSample], outputs: list[dict]
    ) -> list[np.ndarray]:
        """`collect` in one process whose every micro-batch recorded every layer (one model
        chunk): each sample's routes are one row of one micro-batch, copied out of it (the
        general path's result without its per-sample dictionaries)."""
        result: list[np.ndarray | None] = [None] * len(samples)
        for out in outputs:
            routes = out["routes"].cpu().numpy()  # one copy per micro-batch
            for row, index in enumerate(out["indices"]):
                sample = samples[index]
                length = len(sample.prompt_ids) + len(sample.response_ids)
                result[index] = routes[row, : length - 1].copy()
        for i, routes in enumerate(result):
            if routes is None:
                raise RuntimeError(f"routes of sample {i} cover 0 of {self.num_layers} layers")
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

    def _count(
        self,
        layer: int,
        *,
        valid: torch.Tensor,
        changed: tuple[torch.Tensor, torch.Tensor] | None = None,
        routed: bool = True,
        replayed: bool = False,
    ) -> None:
        """Add one router call's tokens (`valid`): routed (a call of the router itself),
        replayed, and when `changed` gives (its own routes, the routes the batch carries) the
        tokens where they differ."""
        zero = valid.new_zeros((), dtype=torch.int64)
        tokens = valid.sum()
        n_changed = n_compared = zero
        if changed is not None:
            new, old = changed
            same = torch.sort(new, dim=-1).values == torch.sort(old.to(new.dtype), dim=-1).values
            n_changed, n_compared = (~same.all(dim=-1) & valid).sum(), tokens
        row = torch.stack(
            [n_changed, n_compared, tokens if replayed else zero, tokens if routed else zero]
        )
        if self._counts is None:
            self._counts = torch.zeros(self.num_layers, 4, dtype=torch.int64, device=valid.device)
        self._counts[layer] += row

    def _instrument(self, replay_obj, layer: int) -> None:
        """Keep the experts a replaying router returned (`used_topk_idx`), and while counting
        (`begin`) count every forward router call's tokens, and while replaying also compute
        the router's own top-k (route changes)."""
        recorder = self
        original = replay_obj.get_replay_topk
        replay_obj.used_topk_idx = None

        def get_replay_topk(
            obj, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
        ):
            action = obj.router_replay_action
            out = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if action == RouterReplayAction.REPLAY_BACKWARD:
                return out  # activation recomputation: already counted in the forward
            if action == RouterReplayAction.REPLAY_FORWARD:
                obj.used_topk_idx = out[1]
            if not recorder.count:
                return out
            valid = recorder._valid
            if valid is None:
                valid = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
            if action == RouterReplayAction.REPLAY_FORWARD:
                _, natural = default_compute_topk(
                    scores, topk, num_groups=num_groups, group_topk=group_topk
                )
                target = obj.target_topk_idx.to(natural.device)
                recorder._count(layer, valid=valid, changed=(natural, target), replayed=True)
            else:
                recorder._count(layer, valid=valid)
            return out

        replay_obj.get_replay_topk = types.MethodType(get_replay_topk, replay_obj)
