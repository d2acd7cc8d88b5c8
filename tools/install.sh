#!/usr/bin/env bash
# Install gspo-megatron into the active Python environment.
#   bash tools/install.sh          # the package (run the trainer)
#   bash tools/install.sh test     # plus what the test suite needs
# Why a script: megatron-core 0.19.2 declares Requires-Python >=3.12 yet ships a cp311 wheel that
# works, so it is installed with --no-deps after its few real dependencies; torch is pinned to a
# CPU-sized release when none is installed (an unpinned torch pulls a multi-GB CUDA build); and
# SGLang's request classes, which the client tests validate against, come without SGLang's CUDA
# dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
pip="python -m pip"

python -c 'import torch' 2>/dev/null || $pip install "torch==2.13.0"
$pip install "numpy>=1.26" "packaging>=24.2"
$pip install --no-deps --ignore-requires-python "megatron-core==0.19.2"
if [ "$extra" = "test" ]; then
  $pip install -e ".[test,slurm]"
  $pip install --no-deps "sglang==0.5.23"
else
  $pip install -e .
fi
