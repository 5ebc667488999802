#!/usr/bin/env bash
# Set up this checkout on a fresh machine and run the test suite: CPU torch 2.13.0 when no
# torch is installed, the package with its test extras, then pytest (arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install torch==2.13.0
fi
"$PY" -m pip install -e ".[dev]"
export OMP_NUM_THREADS=1
exec "$PY" -m pytest -q "$@"
