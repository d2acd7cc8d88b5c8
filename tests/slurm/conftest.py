"""A real one-node Slurm cluster for the tests in this directory (tests/slurm/local_cluster.py).

Installed with apt when missing (root), started on localhost with its own config, stopped at the
end of the session. Where Slurm cannot be installed or started the tests that need it are
skipped and the reason is printed (pytest -ra).
"""

from __future__ import annotations

import getpass
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from local_cluster import LocalSlurm, SlurmUnavailable, install  # noqa: E402


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        install()
        cluster.start()
    except (SlurmUnavailable, OSError, subprocess.SubprocessError) as err:
        cluster.stop()
        pytest.skip(f"Slurm cannot be installed or started here: {err}")
    try:
        yield cluster
    finally:
        user = getpass.getuser()
        subprocess.run(
            ["scancel", "--full", f"--user={user}"], env=cluster.env, capture_output=True
        )
        cluster.stop()
