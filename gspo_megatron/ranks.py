"""What the trainer needs from the other ranks: its rank, rank 0's objects, and votes.

`ProcessGroupRanks` is torch.distributed's default group (NCCL on GPUs, so votes travel as
accelerator tensors) and, on GPUs, a gloo group for objects; `SingleRank` is a job of one
process with no process group, for tests and tools that drive the trainer without
torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gspo_megatron.device import accelerator, on_accelerator


class Ranks(Protocol):
    rank: int

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""

    def any(self, flags: Sequence[bool]) -> list[bool]:
        """Per flag: whether it is true on any rank (one collective for all flags)."""


class ProcessGroupRanks:
    def __init__(self) -> None:
        self.rank = dist.get_rank()
        # A job of one process has nothing to exchange (and a collective costs a thread handoff).
        self._alone = dist.get_world_size() == 1
        # Objects (rollout samples with their routes can be gigabytes) travel through host
        # memory on a gloo group, not through accelerator buffers on NCCL.
        self._objects = dist.new_group(backend="gloo") if on_accelerator() else None

    def broadcast(self, obj: Any) -> Any:
        if self._alone:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._objects)
        return box[0]

    def any(self, flags: Sequence[bool]) -> list[bool]:
        if self._alone:
            return [bool(f) for f in flags]
        votes = torch.tensor([float(f) for f in flags], device=accelerator())
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return [bool(v) for v in votes.tolist()]


class SingleRank:
    rank = 0

    def broadcast(self, obj: Any) -> Any:
        return obj

    def any(self, flags: Sequence[bool]) -> list[bool]:
        return [bool(f) for f in flags]
