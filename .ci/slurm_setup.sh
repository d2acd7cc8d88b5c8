#!/usr/bin/env bash
# CI step before the tests: install Debian's Slurm packages (slurmctld, slurmd, slurm-client,
# munge), shellcheck and libseccomp2 (the code reward's sandbox filter: apt depends on it, so
# every Debian or Ubuntu has it, but a minimal image may not; the sandbox tests try again).
# tests/slurm starts and stops its own one-node cluster and installs Slurm itself when missing
# (so a developer's checkout behaves the same); this step makes an install failure visible
# here. Never fatal: where Slurm cannot be installed, the Slurm tests are skipped and print why.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 0
python tests/slurm/local_cluster.py install \
  || echo "warning: Slurm could not be installed; the tests in tests/slurm will be skipped"
if ! command -v shellcheck >/dev/null && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q shellcheck >/dev/null \
    || echo "warning: shellcheck could not be installed; the script lint test will be skipped"
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libseccomp2 >/dev/null \
    || echo "warning: libseccomp2 could not be installed; the sandbox tests will say so and skip"
fi
exit 0
