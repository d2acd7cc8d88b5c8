"""Where tensors live: the one place that decides the accelerator device.

Model compute, micro-batches, route tensors and every tensor given to a collective on an NCCL
group belong on `accelerator()`: the current CUDA device on a GPU machine, the CPU otherwise.
Host-side bookkeeping (sample lists, metrics, object collectives) stays on the CPU and crosses
to the accelerator only through `to_accelerator`.

Tests can emulate an accelerator on CPU (tests/device_emulation.py): then
`accelerator()` names a CUDA device that the emulation places on the CPU while telling its
tensors apart from host tensors. Nothing else changes here.
"""

from __future__ import annotations

import torch

_emulated: torch.device | None = None


def accelerator() -> torch.device:
    """The device for model tensors and collectives on NCCL groups."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _emulated if _emulated is not None else torch.device("cpu")


def on_accelerator() -> bool:
    """True when `accelerator()` is a real or emulated GPU (not the plain CPU)."""
    return accelerator().type != "cpu"


def to_accelerator(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor` on the accelerator; host tensors are copied without blocking the host where
    the copy can overlap (pinned source memory)."""
    if tensor is None:
        return None
    device = accelerator()
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.is_pinned())


def pinned_for_accelerator(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in page-locked host memory when the accelerator is a GPU, so that its copy there
    can run without blocking the host; unchanged on the CPU."""
    if accelerator().type != "cuda" or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def set_emulated_accelerator(device: torch.device | None) -> None:
    """Test-only: make `accelerator()` name `device` on a machine without CUDA (see the
    device emulation); None switches it off."""
    global _emulated
    _emulated = device
