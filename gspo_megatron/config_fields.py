"""Config fields with their allowed values, declared once with the field and checked before any
work (`check_fields`), each error naming the key path.

    lr: float = bounded(3e-4, gt=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    nonfinite: str = choice("skip", "raise")  # the first is the default

Pure: no import beyond the standard library, so every config section can use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what to change."""


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


def choice(*values: Any) -> Any:
    """A dataclass field that must be one of `values`; the first is the default."""
    return dataclasses.field(default=values[0], metadata={"choices": values})


def open_mapping() -> Any:
    """A dataclass field holding a mapping whose keys are someone else's (an environment's
    keyword arguments, a loss's hyper-parameters): `key.name=value` adds a key on the command
    line without Hydra's `+`, and the owner checks the names (config.py's Hydra schema)."""
    return dataclasses.field(default_factory=dict, metadata={"open_keys": True})


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


def check_fields(obj: Any, prefix: str) -> list[str]:
    """'<key> ...' for every field of `obj` (and its nested dataclasses, also in lists:
    `key[i]`) outside its range or choices."""
    problems = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            problems += check_fields(value, key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    problems += check_fields(item, f"{key}[{i}]")
        elif "range" in f.metadata:
            problem = range_problem(value, f.metadata)
            if problem:
                problems.append(f"{key} {problem}")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(f"{key}={value!r} is not one of {list(f.metadata['choices'])}")
    return problems


def raise_on_problems(obj: Any, prefix: str, error: type[Exception] = ValueError) -> None:
    """`check_fields`, raising `error` with the first problem (and how many more there are)."""
    problems = check_fields(obj, prefix)
    if problems:
        more = f" (and {len(problems) - 1} more)" if problems[1:] else ""
        raise error(problems[0] + more)
