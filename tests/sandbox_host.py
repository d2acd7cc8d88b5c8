"""What the sandbox tests need from the host: root (CI runs as root: the slots run programs as
uids of their own) and libseccomp2 (the syscall filter), which is installed with apt-get when
missing, as .ci/slurm_setup.sh does. Tests skip, saying why, only when it cannot be."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess

import pytest


def _has_libseccomp() -> bool:
    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return False
    return True


@functools.cache
def skip_reason() -> str | None:
    """None when the sandbox can run here; else why not."""
    if os.geteuid() != 0:
        return "the sandbox suite runs as root (as CI does)"
    if _has_libseccomp():
        return None
    if shutil.which("apt-get") is None:
        return "libseccomp2 is not installed and apt-get is not available to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "libseccomp2"]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:  # stale package lists: refresh once
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    if _has_libseccomp():
        return None
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return f"libseccomp2 is not installed and apt-get could not install it: {tail}"


requires_sandbox = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
