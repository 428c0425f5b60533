#!/usr/bin/env bash
# Wheels the GPU machine lacks, for scripts/gpu_check.sh (issue 29): that machine has torch,
# transformers, triton, pytest, safetensors, tokenizers, numpy, msgpack and xxhash and reaches no
# network. This downloads (here, from PyPI) the test suite's other packages for its Python 3.12 /
# x86_64 into .gpu-wheels/ (ignored by git), at the versions make setup installs here; the device
# tool carries the folder with the tree (run carry: [".gpu-wheels"]), and gpu_check.sh installs
# them with --no-index --no-deps. Under 64 MiB all together (the carry limit); prints the size.
# Not smg (37 MB alone): the gateway tests skip there, saying so; they route, they need no GPU.
#
#   scripts/gpu_wheels.sh            # into .gpu-wheels/
#   GPU_PY=3.12 scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS:-.gpu-wheels}
PYV=${GPU_PY:-3.12}
PIP=${PIP:-.venv/bin/python -m pip}
# The version of a package as installed here (the venv make setup built), else the newest.
ver() { { $PIP show "$1" 2>/dev/null || true; } | sed -n "s/^Version: //p"; }
PKGS=(
  pytest-xdist execnet pytest-timeout hypothesis sortedcontainers attrs
  pyzmq fastapi annotated-doc starlette pydantic pydantic_core annotated-types typing-inspection
  opentelemetry-api importlib-metadata zipp
  anyio sniffio idna uvicorn h11 click prometheus-client httpx httpcore certifi
  aiofiles rich markdown-it-py mdurl pygments jsonschema jsonschema-specifications referencing
  rpds-py xgrammar apache-tvm-ffi openai distro jiter redis tqdm msgspec
  matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six
)
mkdir -p "$DEST"
SPECS=()
for p in "${PKGS[@]}"; do
  v=$(ver "$p")
  SPECS+=("${p}${v:+==$v}")
done
# shellcheck disable=SC2086
PIP_CONFIG_FILE=/dev/null $PIP download -q --no-deps --only-binary=:all: -d "$DEST" \
  --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any "${SPECS[@]}"
du -sh "$DEST"
ls "$DEST" | wc -l
