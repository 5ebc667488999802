#!/usr/bin/env bash
# Set up this checkout on a fresh machine and run the test suite (arguments go to pytest).
# Without arguments, the Megatron parts then run once more on megatron-core 0.19.x
# (scripts/test_mcore019.sh; MCORE019=0 skips that leg).
set -euo pipefail
source "$(dirname "$0")/setup.sh" dev
"$PY" -m ruff check .  # lint and import order (pyproject.toml)
"$PY" -m pytest -q "$@"
if [[ $# -eq 0 && ${MCORE019:-1} != 0 ]]; then
  bash scripts/test_mcore019.sh
fi
