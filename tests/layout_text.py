"""The workers' `--layout` text, e.g. `tp=2,sp=1,pp=2,vpp=2,cp=2,ep=2,etp=2`, as a
ParallelLayout: one parser for every worker (tests/launch.py puts this directory on their path)."""

from __future__ import annotations

from gspo_megatron.spec.layout import ParallelLayout

KEYS = ("tp", "sp", "pp", "vpp", "cp", "ep", "etp")


def parse_layout(text: str, world_size: int) -> ParallelLayout:
    """Unnamed sizes are 1; `sp=1` turns sequence parallelism on."""
    values = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise ValueError(f"layout {text!r}: unknown key {key!r} (known: {', '.join(KEYS)})")
        values[key] = int(value)
    return ParallelLayout(
        tp=values.get("tp", 1),
        pp=values.get("pp", 1),
        vpp=values.get("vpp", 1),
        cp=values.get("cp", 1),
        ep=values.get("ep", 1),
        etp=values.get("etp", 1),
        sequence_parallel=bool(values.get("sp", 0)),
        world_size=world_size,
    )
