#!/usr/bin/env bash
# Fetches, on a machine with a package index, the wheels scripts/gpu_check.sh installs on a
# GPU machine without one: pytest and what it needs, and megatron-core, for CPython 3.12 on
# x86-64 Linux (manylinux). torch, numpy, packaging, pyyaml and psutil are expected there.
#   scripts/gpu_wheels.sh [DIR]      (default .whl/, ignored by git; carry it beside the checkout)
# PYVER=3.11 (say) fetches for another Python.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYVER=${PYVER:-3.12}
PINS=(pytest==9.0.3 iniconfig==2.3.0 pluggy==1.6.0 pygments==2.20.0 megatron-core==0.19.2)
mkdir -p "$DIR"
for pin in "${PINS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "$pin"
done
ls -1 "$DIR"/*.whl
