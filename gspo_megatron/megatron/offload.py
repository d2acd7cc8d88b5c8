"""The training engine's state off the accelerator while rollouts generate, and back.

Colocated RL shares every GPU between training and generation. While the rollout engine
generates, the trainer's optimizer state, gradient buffers and (when the rollout engine has its
own copy) weights sit idle. `StateOffloader` copies them to host memory (pinned on a GPU,
allocated once and reused) and frees their device storage with `untyped_storage().resize_(0)`:
every view into it (parameters into DDP's contiguous buffer, `main_grad` views, the distributed
optimizer's shards) stays a valid object, and holds its data again once the storage is resized
and copied back. Gradient buffers are freed without a copy: every optimizer step zeroes them
first. Storages are collected afresh at every offload (the optimizer creates its state at the
first step and a checkpoint load replaces it), each once however many tensors view it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from gspo_megatron.device import accelerator, pinned_for_accelerator


@dataclass
class _Region:
    view: torch.Tensor  # uint8, the whole storage
    nbytes: int
    copy: bool  # False: freed and zeroed on reload (gradient buffers)


class StateOffloader:
    """Moves one engine's state to host memory and back; `offload` and `reload` are idempotent.

    what: optimizer (optimizer state and fp32 main parameters) or all (also gradient buffers and
    weights). keep_weights: the weights stay (the embedded rollout engine generates with them).
    """

    def __init__(self, engine, what: str, *, keep_weights: bool) -> None:
        if what not in ("optimizer", "all"):
            raise ValueError(f"offload {what!r} is not one of 'optimizer', 'all'")
        self.engine = engine
        self.what = what
        self.keep_weights = keep_weights
        self._regions: list[_Region] = []
        self._host: list[torch.Tensor] = []
        self.offloaded = False

    @property
    def host_copies(self) -> list[torch.Tensor]:
        """The host buffers holding the copied state (kept between offloads)."""
        return list(self._host)

    def offload(self) -> dict[str, float]:
        """Free the device storage of the chosen state; returns seconds and bytes copied."""
        if self.offloaded:
            return {}
        started = time.perf_counter()
        self._regions = list(self._collect())
        sizes = [r.nbytes for r in self._regions if r.copy]
        if [h.numel() for h in self._host] != sizes:
            self._host = [pinned_for_accelerator(torch.empty(n, dtype=torch.uint8)) for n in sizes]
        host = iter(self._host)
        for region in self._regions:
            if region.copy:
                buffer = next(host)
                buffer.copy_(region.view, non_blocking=buffer.is_pinned())
        _synchronize()  # the copies read the storages freed next
        for region in self._regions:
            region.view.untyped_storage().resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # back to the driver, for the rollout engine's process
        self.offloaded = True
        return {"offload_s": time.perf_counter() - started, "offload_bytes": float(sum(sizes))}

    def reload(self) -> dict[str, float]:
        """Put the state back on the device (gradient buffers zeroed)."""
        if not self.offloaded:
            return {}
        started = time.perf_counter()
        host = iter(self._host)
        copied = 0
        for region in self._regions:
            region.view.untyped_storage().resize_(region.nbytes)
            if region.copy:
                buffer = next(host)
                region.view.copy_(buffer, non_blocking=buffer.is_pinned())
                copied += region.nbytes
            else:
                region.view.zero_()
        _synchronize()
        self._regions = []
        self.offloaded = False
        return {"reload_s": time.perf_counter() - started, "reload_bytes": float(copied)}

    def _collect(self) -> Iterator[_Region]:
        engine = self.engine
        weights = _storages(
            t for chunk in engine.unwrapped_chunks for t in (*chunk.parameters(), *chunk.buffers())
        )
        grads = _storages(
            buffer.grad_data
            for m in (engine.model if engine.trainable else [])
            for buffer in (*m.buffers, *m.expert_parallel_buffers)
            if buffer.grad_data is not None
        )
        optimizer = _storages(_optimizer_tensors(engine.optimizer))
        # fp32 parameters are the distributed optimizer's main parameters (views of the weights):
        # they stay with the weights.
        optimizer = {k: v for k, v in optimizer.items() if k not in weights and k not in grads}
        chosen = [(optimizer, True)]
        if self.what == "all":
            chosen.append((grads, False))
            if not self.keep_weights:
                chosen.append((weights, True))
        for storages, copy in chosen:
            for view in storages.values():
                yield _Region(view=view, nbytes=view.numel(), copy=copy)


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each distinct non-empty device storage among `tensors`, as a uint8 view of all of it."""
    device = accelerator()
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or tensor.device.type != device.type:
            continue
        key = storage.data_ptr()
        if key not in found:
            found[key] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    return found


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
