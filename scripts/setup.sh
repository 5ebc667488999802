#!/usr/bin/env bash
# Set up this checkout on a fresh machine: CPU torch 2.13.0 when no torch is installed, then
# the package in editable mode with the extras given as the first argument (e.g. "dev").
# Sourced by test.sh and demo.sh; leaves PY set to the Python it used.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install torch==2.13.0
fi
"$PY" -m pip install -e ".[$1]"
export OMP_NUM_THREADS=1
