"""Numeric config fields with their allowed range, declared once with the field and checked
before any work (`check_ranges`), each error naming the key path.

    lr: float = bounded(3e-4, gt=0)
    top_p: float = bounded(1.0, gt=0, le=1)

Pure: no import beyond the standard library, so every config section can use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def bounded(
    default: float | int,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    special: tuple[float | int, ...] = (),
) -> Any:
    """A dataclass field whose value must satisfy the given bounds (or be one of `special`,
    e.g. -1 for "off")."""
    return dataclasses.field(
        default=default,
        metadata={"range": {"ge": ge, "gt": gt, "le": le, "lt": lt}, "special": special},
    )


def range_text(metadata: dict[str, Any]) -> str:
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{ops[k]} {v:g}" for k, v in metadata["range"].items() if v is not None]
    text = " and ".join(parts)
    if metadata["special"]:
        text += " (or " + " / ".join(f"{v:g}" for v in metadata["special"]) + ")"
    return text


def range_problem(value: Any, metadata: dict[str, Any]) -> str | None:
    """Why `value` is out of its field's range, or None."""
    if value is None or value in metadata["special"]:
        return None
    if isinstance(value, float) and math.isnan(value):
        return "must be a number, got nan"
    bounds = metadata["range"]
    ok = (
        (bounds["ge"] is None or value >= bounds["ge"])
        and (bounds["gt"] is None or value > bounds["gt"])
        and (bounds["le"] is None or value <= bounds["le"])
        and (bounds["lt"] is None or value < bounds["lt"])
    )
    return None if ok else f"must be {range_text(metadata)}, got {value!r}"


def check_ranges(obj: Any, prefix: str) -> list[str]:
    """'<key> must be ...' for every bounded field of `obj` and its nested dataclasses."""
    problems = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            problems += check_ranges(value, key)
        elif "range" in f.metadata:
            problem = range_problem(value, f.metadata)
            if problem:
                problems.append(f"{key} {problem}")
    return problems
