"""The layering of docs/ARCHITECTURE.md §1, as import-linter contracts ([tool.importlinter] in
pyproject.toml): the layers, megatron-core only under gspo_megatron/megatron/ (and the embedded
engine that runs its model), no import cycles. `lint-imports` must keep them all, and must break
them when a module imports against them (so the contracts are not vacuous)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO


def lint_imports(root: Path, contract: str | None = None) -> subprocess.CompletedProcess:
    """`lint-imports` over the package under `root`, with `root`'s pyproject.toml (one contract,
    by its id, or all)."""
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
               "lint_imports_command()", "--no-cache"]  # fmt: skip
    if contract is not None:
        command += ["--contract", contract]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    return subprocess.run(command, capture_output=True, text=True, cwd=root, env=env, timeout=300)


def test_the_package_keeps_its_layering_contracts():
    proc = lint_imports(REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "4 kept, 0 broken" in out, out


@pytest.mark.parametrize(
    ("module", "line", "contract", "named"),
    [
        ("algorithms/losses.py", "from gspo_megatron import trainer", "layers",
         "gspo_megatron.algorithms.losses -> gspo_megatron.trainer"),
        ("collector.py", "import megatron.core", "megatron-core",
         "gspo_megatron.collector -> megatron"),
        ("rollout/driver.py", "from gspo_megatron.rollout import pipeline", "acyclic",
         ".pipeline -> .driver"),
        ("config.py", "from gspo_megatron.megatron import parallel", "pure",
         "gspo_megatron.config -> gspo_megatron.megatron.parallel"),
    ],
    ids=["upward", "megatron-core", "cycle", "config-reaches-megatron"],
)  # fmt: skip
def test_an_import_against_a_contract_breaks_it(tmp_path, module, line, contract, named):
    shutil.copytree(REPO / "gspo_megatron", tmp_path / "gspo_megatron")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint_imports(tmp_path, contract).returncode == 0  # kept before
    path = tmp_path / "gspo_megatron" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    proc = lint_imports(tmp_path, contract)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "BROKEN" in out and named in out, out


def test_the_layers_and_acyclic_contracts_list_no_exceptions():
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    by_id = {c["id"]: c for c in contracts["contracts"]}
    assert not by_id["layers"].get("ignore_imports"), by_id["layers"]["ignore_imports"]
    assert not by_id["acyclic"].get("ignore_imports"), by_id["acyclic"]["ignore_imports"]
