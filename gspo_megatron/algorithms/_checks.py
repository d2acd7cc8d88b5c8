"""Input checks shared by the algorithms modules; each error names the argument to fix."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor


def shape(t: Tensor) -> list[int]:
    return list(t.shape)


def require_tensor(name: str, value: object, *, floating: bool = False) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    return value


def require_shape(name: str, value: Tensor, expected: list[int], what: str) -> None:
    if shape(value) != expected:
        raise ValueError(f"{name} must have shape {expected} ({what}), got {shape(value)}")


def require_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    strict: bool = False,
    owner: str = "",
) -> float:
    """A finite real number, optionally bounded below (``> minimum`` when strict)."""
    where = f" (loss {owner!r})" if owner else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}{where} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}{where} must be finite, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"{name}{where} must be {bound}, got {value:g}")
    return value


def raise_if_flagged(flags: Mapping[str, Tensor]) -> None:
    """Raise for the first flag that is true, with one host sync for all of them.

    ``flags`` maps an error message (starting with the argument's name) to a 0-d bool tensor.
    """
    if not flags:
        return
    values = torch.stack([f.reshape(()).to(torch.bool) for f in flags.values()]).tolist()
    for message, bad in zip(flags, values, strict=True):
        if bad:
            raise ValueError(message)


def nonfinite_on(values: Tensor, mask: Tensor) -> Tensor:
    """0-d bool: some entry of ``values`` is NaN/inf where ``mask`` is true (no host sync)."""
    return torch.where(mask, ~torch.isfinite(values), False).any()
