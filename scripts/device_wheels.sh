#!/usr/bin/env bash
# Wheels for a GPU machine that has torch, triton and transformers but no network: downloads,
# here, into ./.whl the packages arle and its GPU tests need beyond those (Python 3.12, x86-64).
#   bash scripts/device_wheels.sh [EXTRA_PACKAGE ...]
# Then copy .whl to that machine and run scripts/gpu_session.sh there, which installs them.
# Adjust PYTHON_VERSION for another interpreter there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
mkdir -p .whl
pkgs=(starlette pydantic pydantic-core annotated-types typing-inspection uvicorn structlog orjson
      prompt-toolkit wcwidth gguf openai jiter distro sniffio pytest-asyncio llguidance
      # the CPU test files' needs (gpu_session.sh all runs them there too); h11 at CI's version
      jsonschema jsonschema-specifications referencing rpds-py httpx2 h11 "$@")
platforms=()
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
# NOTE: the versions CI tests (.ci/constraints.txt), so both machines run the same code
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
  -c .ci/constraints.txt --implementation cp "${platforms[@]}" -d .whl "${pkgs[@]}"
# NOTE: one version of each package: two make the install there fail as a whole
dups=$(ls .whl | sed -E 's/-[0-9].*//' | tr '_' '-' | tr '[:upper:]' '[:lower:]' | sort | uniq -d)
[ -z "$dups" ] || { echo "several versions of: $dups (delete all but one from .whl)" >&2; exit 1; }
du -sh .whl
