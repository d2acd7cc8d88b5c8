"""The workers' `--layout` text, e.g. `tp=2,sp=1,pp=2,vpp=2,cp=2,ep=2,etp=2`, as a
ParallelLayout: one parser for every worker (tests/launch.py puts this directory on their path),
and the layouts every exactness test runs (`VERIFIED_LAYOUTS`)."""

from __future__ import annotations

from gspo_megatron.spec.layout import ParallelLayout

KEYS = ("tp", "sp", "pp", "vpp", "cp", "ep", "etp")

# (layout text, process count, test id): tests/megatron/test_layouts.py and test_lora_layouts.py
VERIFIED_LAYOUTS = [
    ("", 1, "single"),
    ("tp=2,sp=1", 2, "tp2-sp"),
    ("pp=2", 2, "pp2"),
    ("pp=2,vpp=2", 2, "pp2-vpp2"),
    ("ep=2", 2, "ep2"),
    ("cp=2", 2, "cp2"),
    ("", 2, "dp2"),
    ("tp=2,sp=1,pp=2,ep=2", 4, "tp2-pp2-ep2"),
    ("tp=2,sp=1,cp=2", 4, "tp2-cp2"),
    ("tp=2,sp=1,ep=2,etp=2", 4, "tp2-ep2-etp2"),
]


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
