"""User plug-ins named "package.module:attribute" in a config (rewards, environments)."""

from __future__ import annotations

import importlib
from typing import Any


def import_attr(spec: str, key: str) -> Any:
    """The attribute `spec` names; a ValueError naming the config `key` when it cannot be had."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's module, named
        raise ValueError(
            f"{key}={spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{key}={spec!r}: module {module_name!r} has no {attr!r}") from None
