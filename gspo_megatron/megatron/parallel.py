"""Process groups and megatron's parallel state from a ParallelLayout."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel import random as tp_random

from gspo_megatron.megatron.cpu_compat import cuda_available
from gspo_megatron.network import free_port
from gspo_megatron.spec.layout import LayoutError, ParallelLayout


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize(layout: ParallelLayout, seed: int, *, timeout_s: float = 600.0) -> None:
    """Start torch.distributed (NCCL on GPU, gloo on CPU) and megatron's parallel groups.

    A single process without torchrun gets a one-rank group on a free local port.
    """
    world = world_size_from_env()
    if layout.world_size != world:
        raise LayoutError(
            f"the layout was validated for {layout.world_size} processes but WORLD_SIZE={world}"
        )
    if not dist.is_initialized():
        if world == 1 and "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(free_port())
        rank = int(os.environ.get("RANK", "0"))
        if cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if cuda_available() else "gloo",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        initialize_model_parallel(layout)
    seed_everything(seed)


def initialize_model_parallel(layout: ParallelLayout, **options) -> None:
    """megatron's parallel groups for `layout` on the existing default process group; `options`
    go to megatron's `initialize_model_parallel` as they are."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        **options,
    )


def seed_everything(seed: int) -> None:
    """Seed torch's generators and megatron's RNG tracker (TP/EP-aware streams)."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_model_parallel() -> None:
    """megatron's parallel groups, leaving the default process group (a process that runs
    several layouts one after another initializes the next on it)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # destroy_model_parallel (megatron-core 0.19.2) leaves some groups in its module globals
    # (_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP and its gloo twin): they would keep their
    # process groups, and their threads, alive after destroy_process_group.
    for name, value in vars(parallel_state).items():
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)


# megatron-core keeps the groups, ranks and model-parallel RNG streams of the one layout it knows
# in these modules' globals (_TENSOR_MODEL_PARALLEL_GROUP, _CUDA_RNG_STATE_TRACKER, ...).
_STATE_MODULES = (parallel_state, tp_random)
_STATE_NAME = re.compile(r"_[A-Z][A-Z0-9_]*")


def _capture() -> dict[tuple[object, str], object]:
    return {
        (module, name): value
        for module in _STATE_MODULES
        for name, value in vars(module).items()
        if _STATE_NAME.fullmatch(name)
    }


def _install(state: dict[tuple[object, str], object]) -> None:
    for (module, name), value in state.items():
        setattr(module, name, value)


class LayoutGroups:
    """megatron's parallel state for a second layout in the same processes (PPO's critic on a
    layout of its own): process groups made once, collectively, on every rank, and the
    model-parallel RNG streams seeded for that layout. `active()` swaps them into megatron's
    module globals for a block and back out, so megatron (and this project's code, which asks
    megatron for its groups at call time) sees one layout at a time. Build it after
    `initialize`, on every rank in the same order; the policy's state is left as it was,
    torch's generators included.
    """

    def __init__(self, layout: ParallelLayout, seed: int) -> None:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("LayoutGroups needs the first layout initialized (initialize)")
        if layout.world_size != dist.get_world_size():
            raise LayoutError(
                f"a layout for {layout.world_size} processes in a world of {dist.get_world_size()}"
            )
        self.layout = layout
        outer = _capture()
        devices = [torch.cuda.current_device()] if cuda_available() else []
        try:
            with torch.random.fork_rng(devices=devices):
                destroy_model_parallel()
                parallel_state._HYBRID_DP_CP_GROUPS = {}  # filled in place, not reset by destroy
                tp_random._CUDA_RNG_STATE_TRACKER = None
                tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
                initialize_model_parallel(layout)
                model_parallel_cuda_manual_seed(seed)
                self._state = _capture()
        finally:
            _install(outer)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        outer = _capture()
        _install(self._state)
        try:
            yield
        finally:
            self._state = _capture()  # what megatron set meanwhile (VPP rank, RNG states, ...)
            _install(outer)
