"""The fault hooks (tests/faults/inject/sitecustomize.py) patch functions of the product by
module name when that module is imported: a module that moved would leave its faults never
firing, silently (a soak would count them as not thrown). Every name must be a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

HOOKS = Path(__file__).parent / "inject" / "sitecustomize.py"


def test_every_patched_module_exists():
    spec = importlib.util.spec_from_file_location("fault_hooks", HOOKS)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)  # GSPO_FAULTS unset here: nothing is armed
    assert hooks._PATCHES
    missing = [name for name in hooks._PATCHES if importlib.util.find_spec(name) is None]
    assert not missing, f"fault hooks patch modules that do not exist: {missing}"
