"""Offline install: tools/make_wheelhouse.sh fetches a closed set of wheels for this machine's
Python, and tools/install.sh --wheelhouse installs the package from it into a fresh virtual
environment with no package index (as on an air-gapped GPU cluster, where torch is already
installed: here this environment's torch, linked in from outside the new one). Slow: ~1 minute
on 2 cores, resolving the wheelhouse and unpacking its wheels.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def test_install_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = [str(REPO / "tools" / name) for name in ("install.sh", "make_wheelhouse.sh")]
    proc = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_offline_install_from_a_wheelhouse(tmp_path):
    machine = platform.machine()  # x86_64 or aarch64
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheelhouse, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    timings: dict[str, float] = {}
    env = dict(os.environ, PIP_NO_COMPILE="1")  # byte-compiling torch costs more than it saves
    env.pop("VIRTUAL_ENV", None)

    # The download (mostly waiting on the network) overlaps the venv and torch (unpacking).
    started = time.perf_counter()
    platforms = [f"manylinux_2_{n}_{machine}" for n in (28, 27, 17)] + [f"manylinux2014_{machine}"]
    cmd = ["bash", "tools/make_wheelhouse.sh", "--python-version", version]
    for tag in platforms:
        cmd += ["--platform", tag]
    wheelhouse.mkdir()
    log = tmp_path / "make_wheelhouse.log"
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the download
        cmd += [str(wheelhouse)]
        download = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, cwd=REPO)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        python = str(venv / "bin" / "python")
        venv_env = dict(env, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env['PATH']}")
        # No index, no pip configuration (it names local wheel folders here): DIR alone.
        offline_env = dict(venv_env, PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)
        offline_env.pop("PIP_FIND_LINKS", None)
        install = ["bash", "tools/install.sh", "--wheelhouse", str(wheelhouse)]

        proc = run(install, offline_env)  # before torch: one clear line, nothing installed
        assert proc.returncode == 1 and "torch is not installed" in proc.stderr, proc.stderr

        # torch as a cluster image ships it, outside the environment: this environment's CPU
        # build, as a CUDA build would be there (linked, not unpacked again: ~700 MB).
        site_packages = venv / "lib" / f"python{version}" / "site-packages"
        ship_outside(torch_closure(), tmp_path / "image", site_packages / "image.pth")
        proc = run([python, "-m", "pip", "show", "torch"], venv_env)
        assert proc.returncode == 0 and "Version: 2.13.0+cpu" in proc.stdout, proc.stderr
        timings["venv + torch"] = time.perf_counter() - started
    finally:
        downloaded = download.wait(timeout=600)
    assert downloaded == 0, log.read_text()[-4000:]
    timings["make_wheelhouse (overlapping)"] = time.perf_counter() - started
    wheels = sorted(p.name.lower() for p in wheelhouse.glob("*.whl"))
    size_mb = sum(p.stat().st_size for p in wheelhouse.glob("*.whl")) / 1e6
    assert any(w.startswith("megatron_core-0.19.2-") for w in wheels), wheels
    for forbidden in ("torch-", "triton-", "nvidia_", "transformer_engine", "pyarrow-"):
        assert not any(w.startswith(forbidden) for w in wheels), (forbidden, wheels)
    assert size_mb < 100, f"wheelhouse grew to {size_mb:.0f} MB"

    started = time.perf_counter()
    proc = run(install, offline_env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    timings["install.sh --wheelhouse"] = time.perf_counter() - started

    started = time.perf_counter()
    check = (
        "import torch, gspo_megatron; from gspo_megatron.megatron import cpu_compat; "
        "assert cpu_compat.apply(); import megatron.core, hydra, math_verify; "
        "from gspo_megatron.megatron.training_engine import TrainingEngine; "
        "print(torch.__version__, gspo_megatron.__file__, megatron.core.__file__)"
    )
    proc = subprocess.run(
        [python, "-W", "ignore", "-c", check],
        capture_output=True, text=True, env=venv_env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch_version, package, megatron = proc.stdout.split()
    timings["imports"] = time.perf_counter() - started
    assert torch_version == "2.13.0+cpu"  # never replaced from the wheelhouse
    assert not list(site_packages.glob("torch*")), "pip installed torch into the environment"
    assert Path(package).is_relative_to(REPO)  # editable: this checkout
    assert Path(megatron).is_relative_to(venv)
    print(f"\nwheelhouse: {len(wheels)} wheels, {size_mb:.0f} MB; timings (s):", end=" ")
    print(", ".join(f"{k} {v:.0f}" for k, v in timings.items()))


def torch_closure() -> list[importlib.metadata.Distribution]:
    """torch and the distributions it needs, as installed in this environment."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = ["torch"]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found[name] = importlib.metadata.distribution(name)
        for line in found[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonicalize_name(requirement.name))
    return list(found.values())


def ship_outside(dists: list[importlib.metadata.Distribution], image: Path, pth: Path) -> None:
    """Links to the files of `dists` in `image`, a directory that `pth` puts on the path of the
    environment holding it, after its own site-packages (pip sees them installed there, and
    does not uninstall what lies outside its environment)."""
    image.mkdir()
    for dist in dists:
        site = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            (image / top).symlink_to(site / top)
    pth.write_text(f"{image}\n")
