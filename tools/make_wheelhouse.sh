#!/usr/bin/env bash
# Fetch the wheels gspo-megatron needs at run time, for a machine without a package index.
#   bash tools/make_wheelhouse.sh DIR          # Python 3.12, x86_64 manylinux (the GPU machines)
#   bash tools/make_wheelhouse.sh --python-version 3.11 --platform manylinux_2_28_aarch64 DIR
#   options: --extras parquet,plot   also the wheels of these pyproject.toml extras
#            --exclude numpy,pyarrow  resolve these but keep no wheel (the target has them)
# Then, on the target (torch already installed): bash tools/install.sh --wheelhouse DIR [EXTRAS]
#
# DIR gets megatron-core 0.19.2, the runtime dependencies of pyproject.toml and setuptools (the
# build backend, so `pip install --no-index` can build this package) - never torch, which the
# target must already have in its CUDA build, nor what only torch needs. transformer-engine stays
# out (optional, GB-sized). pip resolves the whole set for the target Python and platform, so it
# is closed: installing from DIR with --no-index needs nothing else (but torch, and what
# --exclude names).
set -euo pipefail
cd "$(dirname "$0")/.."

python_version=3.12
platforms=()
extras=""
exclude=""
dest=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) python_version="$2"; shift 2 ;;
    --platform) platforms+=("$2"); shift 2 ;;
    --extras) extras="$2"; shift 2 ;;
    --exclude) exclude="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "make_wheelhouse: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) dest="$1"; shift ;;
  esac
done
[ -n "$dest" ] || { echo "make_wheelhouse: give the output directory (see --help)" >&2; exit 2; }
if [ ${#platforms[@]} -eq 0 ]; then
  # The GPU check machine's tags (x86_64, glibc >= 2.28); pip takes a wheel matching any of them.
  platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
    manylinux2014_x86_64 manylinux1_x86_64)
fi
mkdir -p "$dest"

target=(--python-version "$python_version" --implementation cp --only-binary=:all:)
for p in "${platforms[@]}"; do target+=(--platform "$p"); done

# pyproject.toml is the one list of dependencies; torch is the target's own, megatron-core is
# fetched alone below.
mapfile -t requirements < <(EXTRAS="$extras" python - <<'EOF'
import os
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = list(project["dependencies"])
for extra in filter(None, os.environ["EXTRAS"].split(",")):
    deps += project["optional-dependencies"][extra]
for dep in deps:
    name = re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0].lower()
    if name not in ("torch", "megatron-core"):
        print(dep)
EOF
)

# hydra-core pins antlr4-python3-runtime 4.9.*, published only as a source archive: build its
# pure-Python wheel here (any platform), where the download below finds it through --find-links.
python -m pip wheel -q --no-deps --no-binary antlr4-python3-runtime -w "$dest" \
  "antlr4-python3-runtime==4.9.3"
# megatron-core declares Requires-Python >=3.12 but its cp311 wheel works (tools/install.sh);
# its real dependencies (numpy, packaging) are in pyproject.toml.
python -m pip download -q --no-deps --ignore-requires-python "${target[@]}" -d "$dest" \
  "megatron-core==0.19.2"
python -m pip download -q "${target[@]}" --find-links "$dest" -d "$dest" \
  "setuptools>=68" "${requirements[@]}"

for name in ${exclude//,/ }; do
  # wheel file names spell the project name with underscores, in any case
  pattern="$(echo "$name" | tr '.-' '__')-*.whl"
  find "$dest" -maxdepth 1 -iname "$pattern" -delete
done

count=$(find "$dest" -maxdepth 1 -name '*.whl' | wc -l)
echo "make_wheelhouse: $count wheels, $(du -sh "$dest" | cut -f1) in $dest; largest:"
find "$dest" -maxdepth 1 -name '*.whl' -printf '%s\t%f\n' | sort -rn | head -8 |
  awk -F'\t' '{ printf "  %6.1f MB  %s\n", $1 / 1e6, $2 }'
