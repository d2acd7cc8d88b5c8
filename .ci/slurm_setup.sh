#!/usr/bin/env bash
# CI step before the tests: install Debian's Slurm packages (slurmctld, slurmd, slurm-client,
# munge) and shellcheck. tests/slurm starts and stops its own one-node cluster and installs
# Slurm itself when missing (so a developer's checkout behaves the same); this step makes an
# install failure visible here. Never fatal: where Slurm cannot be installed, the Slurm tests
# are skipped and print why.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 0
python tests/slurm/local_cluster.py install \
  || echo "warning: Slurm could not be installed; the tests in tests/slurm will be skipped"
if ! command -v shellcheck >/dev/null && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q shellcheck >/dev/null \
    || echo "warning: shellcheck could not be installed; the script lint test will be skipped"
fi
exit 0
