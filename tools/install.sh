#!/usr/bin/env bash
# Install gspo-megatron into the active Python environment.
#   bash tools/install.sh                      # the package (run the trainer)
#   bash tools/install.sh test                 # plus what the test suite needs
#   bash tools/install.sh --wheelhouse DIR [EXTRAS]   # offline, from tools/make_wheelhouse.sh
# Why a script: megatron-core 0.19.2 declares Requires-Python >=3.12 yet ships a cp311 wheel that
# works, so it is installed with --no-deps after its few real dependencies; torch is pinned to a
# CPU-sized release when none is installed (an unpinned torch pulls a multi-GB CUDA build); and
# SGLang's request classes, which the client tests validate against, come without SGLang's CUDA
# dependencies.
# Offline (--wheelhouse): nothing but DIR is read (pip --no-index), as on air-gapped clusters.
# torch must already be installed, in the build the machine needs (CUDA): a wheelhouse never
# holds torch, and the installed one is pinned so that no requirement can replace it. EXTRAS:
# comma-separated extras of pyproject.toml whose wheels DIR holds (e.g. parquet,plot).
# PYTHON: the interpreter to install into (default: `python` on the PATH).
set -euo pipefail
python="${PYTHON:-python}"
pip="$python -m pip"
# The code reward's sandbox (reward=code) loads libseccomp, a system package, not a wheel.
$python -c 'import ctypes; ctypes.CDLL("libseccomp.so.2")' 2>/dev/null \
  || echo "install.sh: note: libseccomp2 is missing; reward=code needs it (apt-get install libseccomp2)" >&2

if [ "${1:-}" = "--wheelhouse" ]; then
  dir="${2:?install.sh: --wheelhouse needs a directory (made by tools/make_wheelhouse.sh)}"
  extras="${3:-}"
  [ -d "$dir" ] || { echo "install.sh: wheelhouse $dir is not a directory" >&2; exit 1; }
  dir=$(cd "$dir" && pwd)  # before leaving the caller's directory
  cd "$(dirname "$0")/.."
  torch_version=$($python -c 'import torch; print(torch.__version__)' 2>/dev/null) || {
    echo "install.sh: torch is not installed; install its CUDA build first (never from a wheelhouse)" >&2
    exit 1
  }
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  echo "torch==$torch_version" >"$constraints"
  offline=("$python" -m pip install --no-index --find-links "$dir" --constraint "$constraints")
  "${offline[@]}" "numpy>=1.26" "packaging>=24.2"
  "${offline[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2"
  "${offline[@]}" -e ".${extras:+[$extras]}"
  exit 0
fi

cd "$(dirname "$0")/.."
extra="${1:-}"
$python -c 'import torch' 2>/dev/null || $pip install "torch==2.13.0"
$pip install "numpy>=1.26" "packaging>=24.2"
$pip install --no-deps --ignore-requires-python "megatron-core==0.19.2"
# parquet (pyarrow) and plot (matplotlib) are extras so that an offline wheelhouse can leave
# them out; an online install keeps them, as before.
if [ "$extra" = "test" ]; then
  $pip install -e ".[test,slurm,parquet,plot]"
  $pip install --no-deps "sglang==0.5.23"
else
  $pip install -e ".[parquet,plot]"
fi
